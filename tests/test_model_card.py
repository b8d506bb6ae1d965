"""Model cards: `save_pretrained` writes a card that parses as a Hub model card, and the folder `push_to_hub` would
upload loads with the Auto classes (no network: the Hub calls of `push_to_hub` are replaced by local stand-ins)."""

import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import tiny_model
from huggingface_hub import ModelCard


def test_saved_card_validates_and_describes_the_model(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK, parameter_counts

    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path / "my-kda-moe")
    card = ModelCard.load(tmp_path / "my-kda-moe" / "README.md", ignore_metadata_errors=False)  # strict YAML parse
    # The metadata the Hub's validator checks: a known license, library and pipeline tag, list-valued tags.
    assert card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "kda-moe" in card.data.tags and "mixture-of-experts" in card.data.tags
    assert card.content.startswith("---\n") and GENERATED_MARK in card.text
    counts = parameter_counts(model)
    assert counts["total"] == model.num_parameters() and counts["active"] < counts["total"]
    assert f"{counts['total']:,}" in card.text
    assert "3 KDA + 2 gated MLA" in card.text and "8 routed (top-2) + 1 shared" in card.text
    assert "Block AttnRes, block size 2" in card.text
    assert 'from_pretrained("my-kda-moe")' in card.text and "## License" in card.text and "## Intended use" in card.text
    # A config (no weights) gives the same counts, measured on the meta device.
    assert parameter_counts(model.config) == counts


def test_card_someone_else_wrote_is_kept(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# my own card\n")
    tiny_model(seed=0).save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "---\nlicense: mit\n---\n# my own card\n"
    tiny_model(seed=0).save_pretrained(tmp_path / "again")
    tiny_model(seed=0).save_pretrained(tmp_path / "again")  # our own card is refreshed in place
    assert ModelCard.load(tmp_path / "again" / "README.md").data.license == "apache-2.0"


def _capture_push_to_hub(model, folder: Path):
    """Run `model.push_to_hub` with its three Hub calls replaced: the repo exists, it has no card yet, and the
    upload copies the folder `push_to_hub` built to `folder` instead of sending it."""
    import transformers.utils.hub as hub
    from huggingface_hub.errors import EntryNotFoundError

    def upload(self, working_dir, repo_id, *args, **kwargs):
        shutil.copytree(working_dir, folder)

    def no_card_on_the_hub(*args, **kwargs):
        raise EntryNotFoundError("no README.md in the repository yet")

    api = mock.Mock()
    api.create_repo.return_value = mock.Mock(repo_id="someone/tiny-kda-moe")
    with (
        mock.patch.object(hub, "hf_api", return_value=api),
        mock.patch.object(hub.ModelCard, "load", side_effect=no_card_on_the_hub),
        mock.patch.object(type(model), "_upload_modified_files", upload),
    ):
        model.push_to_hub("someone/tiny-kda-moe")


def test_push_to_hub_folder_loads_with_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = tiny_model(seed=1)
    model.train()
    input_ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids, labels=input_ids).loss.backward()  # non-zero Quantile Balancing biases travel too
    model.eval()
    _capture_push_to_hub(model, tmp_path / "upload")
    files = {p.name for p in (tmp_path / "upload").iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "generation_config.json"} <= files
    assert {"configuration_kda_moe.py", "modeling_kda_moe.py"} <= files  # auto_map targets for trust_remote_code
    config = AutoConfig.from_pretrained(tmp_path / "upload")
    assert config.model_type == "kda_moe_text"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "upload").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    assert type(AutoModel.from_pretrained(tmp_path / "upload")).__name__ == "KdaMoeTextModel"
    ModelCard.load(tmp_path / "upload" / "README.md", ignore_metadata_errors=False)


@pytest.mark.xfail(
    strict=True,
    reason="transformers' PushToHubMixin.push_to_hub saves README.md from create_and_tag_model_card() (the Hub's "
    "card, or a generic one) over the card save_pretrained wrote; needs a KdaMoePreTrainedModel.push_to_hub override",
)
def test_push_to_hub_uploads_the_generated_card(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK

    _capture_push_to_hub(tiny_model(seed=1), tmp_path / "upload")
    assert GENERATED_MARK in (tmp_path / "upload" / "README.md").read_text()
