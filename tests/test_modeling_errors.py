"""Bad input to the model fails loudly with a message that names the problem and the fix."""

import pytest
import torch
from conftest import tiny_model

from kda_moe.kernels import backend


def test_triton_backend_request_fails_loudly_instead_of_falling_back(monkeypatch):
    model = tiny_model(seed=0, kernel_backend="triton")
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    if backend.TRITON_AVAILABLE:  # CPU tensors still need the interpreter
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="CPU|cpu|device"):
            model(input_ids)
    else:
        with pytest.raises(ImportError, match="kernel_backend=.torch."):
            model(input_ids)


def test_environment_variable_overrides_the_config_backend(monkeypatch):
    model = tiny_model(seed=0, kernel_backend="triton")
    monkeypatch.setenv("KDA_MOE_BACKEND", "torch")
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        assert model(input_ids).logits.shape == (1, 5, model.config.vocab_size)


def test_input_ids_and_inputs_embeds_together_are_rejected():
    model = tiny_model(seed=0)
    input_ids = torch.randint(1, model.config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=input_ids, inputs_embeds=model.model.embed_tokens(input_ids))
