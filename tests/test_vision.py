"""The vision tower: packing, 2D position handling, merger, projector, gradient checkpointing, input errors (CPU)."""

import logging

import pytest
import torch
from multimodal_testing import PATCH, tiny_multimodal_config, tiny_multimodal_model

from kda_moe import KdaMoeConfig, KdaMoeForConditionalGeneration, KdaMoeVisionConfig, KdaMoeVisionModel


@pytest.fixture(scope="module")
def model():
    model = tiny_multimodal_model(seed=0)
    with torch.no_grad():  # a non-trivial position table (it starts as small noise)
        model.model.vision_tower.pos_emb.weight.normal_(0, 1.0)
    return model


def patches(grid_h, grid_w, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(grid_h * grid_w, 3 * PATCH * PATCH, generator=generator)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_two_packed_images_match_each_alone(model, implementation):
    tower = model.model.vision_tower
    tower.config._attn_implementation = implementation
    first, second = patches(4, 6, 0), patches(6, 2, 1)
    grids = torch.tensor([[1, 4, 6], [1, 6, 2]])
    with torch.no_grad():
        packed = model.model.get_image_features(torch.cat([first, second]), grids).pooler_output
        alone_first = model.model.get_image_features(first, grids[:1]).pooler_output[0]
        alone_second = model.model.get_image_features(second, grids[1:]).pooler_output[0]
    assert packed[0].shape == (4 * 6 // 4, model.config.text_config.hidden_size)
    assert (packed[0] - alone_first).abs().max() < 1e-5
    assert (packed[1] - alone_second).abs().max() < 1e-5
    tower.config._attn_implementation = "sdpa"


def test_sdpa_matches_eager_in_the_tower(model):
    tower = model.model.vision_tower
    pixels, grids = torch.cat([patches(4, 4, 2), patches(2, 8, 3)]), torch.tensor([[1, 4, 4], [1, 2, 8]])
    with torch.no_grad():
        tower.config._attn_implementation = "eager"
        eager = tower(pixels, grids).last_hidden_state
        tower.config._attn_implementation = "sdpa"
        sdpa = tower(pixels, grids).last_hidden_state
    assert (eager - sdpa).abs().max() < 1e-5


def test_position_table_is_used_at_native_size_and_interpolated_elsewhere(model):
    tower = model.model.vision_tower
    table = tower.pos_emb.weight  # [6, 6, D]
    native = tower.pos_emb([(6, 6)])
    assert torch.equal(native, table.reshape(36, -1))
    resized = tower.pos_emb([(4, 8)])
    expected = torch.nn.functional.interpolate(table.permute(2, 0, 1)[None], size=(4, 8), mode="bicubic")
    assert torch.allclose(resized, expected[0].flatten(1).T, atol=1e-6)


def test_two_dimensional_rope_distinguishes_rows_from_columns(model):
    """A transposed image is a different image: rows and columns rotate different halves of each head."""
    tower = model.model.vision_tower
    grid = patches(2, 4, 4).view(2, 4, -1)
    with torch.no_grad():
        wide = tower(grid.reshape(8, -1), torch.tensor([[1, 2, 4]])).last_hidden_state.view(2, 4, -1)
        tall = tower(grid.transpose(0, 1).reshape(8, -1), torch.tensor([[1, 4, 2]])).last_hidden_state.view(4, 2, -1)
    assert (wide - tall.transpose(0, 1)).abs().max() > 1e-3


def test_patch_merger_concatenates_each_two_by_two_window(model):
    tower = model.model.vision_tower
    hidden = torch.arange(4 * 6, dtype=torch.float)[:, None].expand(-1, 2)  # patch index as the feature
    merged = tower.merge_patches(hidden, [(4, 6)])
    assert merged.shape == (6, 8)
    # merged patch 0 = patches (0,0) (0,1) (1,0) (1,1) = indices 0, 1, 6, 7 in row-major order
    assert merged[0, ::2].tolist() == [0, 1, 6, 7]
    assert merged[4, ::2].tolist() == [14, 15, 20, 21]


def test_tower_has_no_biases_and_uses_rms_norm(model):
    names = [name for name, _ in model.model.vision_tower.named_parameters()]
    names += [name for name, _ in model.model.multi_modal_projector.named_parameters()]
    assert not [name for name in names if name.endswith("bias")]
    assert type(model.model.multi_modal_projector.norm).__name__ == "KdaMoeRMSNorm"
    assert "KdaMoeVisionBlock" in model._no_split_modules and "KdaMoeDecoderLayer" in model._no_split_modules


def test_gradient_checkpointing_in_the_tower_gives_the_same_gradients():
    def vision_grads(checkpointing):
        model = tiny_multimodal_model(seed=3)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.model.vision_tower.gradient_checkpointing
            assert all(block.gradient_checkpointing for block in model.model.vision_tower.blocks)
        pixels, grids = torch.cat([patches(2, 4, 5), patches(4, 2, 6)]), torch.tensor([[1, 2, 4], [1, 4, 2]])
        features = torch.cat(model.model.get_image_features(pixels, grids).pooler_output)
        features.square().sum().backward()
        return {n: p.grad.clone() for n, p in model.model.vision_tower.named_parameters() if p.grad is not None}

    plain, checkpointed = vision_grads(False), vision_grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6), name


@pytest.mark.parametrize(
    "pixels, grids, message",
    [
        (torch.randn(10, 3 * PATCH * PATCH), None, "without `image_grid_thw`"),
        (torch.randn(10, 7), torch.tensor([[1, 2, 5]]), "flattened"),
        (torch.randn(6, 3 * PATCH * PATCH), torch.tensor([[1, 2, 3]]), "multiple of spatial_merge_size"),
        (torch.randn(10, 3 * PATCH * PATCH), torch.tensor([[1, 2, 4]]), "describes 8 patches"),
    ],
)
def test_bad_vision_inputs_raise_value_errors_that_say_what_to_fix(model, pixels, grids, message):
    with pytest.raises(ValueError, match=message):
        model.model.vision_tower(pixels, grids)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_pixel_values_raise_naming_the_image(model, bad_value):
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 2, 2]])
    pixels = torch.cat([patches(4, 4, 0), patches(2, 4, 1), patches(2, 2, 2)])
    pixels[16 + 5, 7] = bad_value  # a patch of the second image
    with pytest.raises(ValueError, match=r"`pixel_values` of image\(s\) \[1\] .* hold NaN or Inf"):
        model.model.vision_tower(pixels, grids)
    input_ids = torch.full((1, 7), model.config.image_token_id)
    with pytest.raises(ValueError, match="hold NaN or Inf"):
        model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grids)


def test_out_of_vocabulary_text_ids_raise_naming_vocab_size(model):
    vocab_size = model.config.text_config.vocab_size
    with pytest.raises(ValueError, match=rf"ids in \[1, {vocab_size}\].*vocab_size={vocab_size}"):
        model(input_ids=torch.tensor([[1, vocab_size, 3]]))
    with pytest.raises(ValueError, match=r"pass `input_ids\[None\]`"):
        model(input_ids=torch.tensor([1, 2, 3]))


def test_sub_config_edits_are_checked_when_a_model_is_built():
    config = tiny_multimodal_config()
    config.text_config.num_experts_per_tok = 100
    with pytest.raises(ValueError, match=r"(?s)`text_config`: .*`num_experts_per_tok`=100 is invalid"):
        KdaMoeForConditionalGeneration(config)
    config = tiny_multimodal_config()
    config.vision_config.num_attention_heads = 3  # 32 / 3 heads
    with pytest.raises(ValueError, match="`num_attention_heads`=3 is invalid: must divide hidden_size=32"):
        KdaMoeForConditionalGeneration(config)
    with pytest.raises(ValueError, match="num_attention_heads"):
        KdaMoeVisionModel(config.vision_config)
    with pytest.raises(ValueError, match="field 'patch_size'"):
        config.vision_config.patch_size = 0
    with pytest.raises(ValueError, match="field 'image_token_id'"):
        config.image_token_id = -1


def test_misspelled_vision_and_multimodal_keys_warn_naming_the_field(caplog):
    with caplog.at_level(logging.WARNING):
        KdaMoeVisionConfig(patch_sz=4)
        KdaMoeConfig(image_token=5)
    assert "`patch_sz`: did you mean `patch_size`?" in caplog.text
    assert "`image_token`: did you mean `image_token_id`?" in caplog.text


def test_vision_config_validation_names_the_field():
    with pytest.raises(ValueError, match="multiple of 4"):
        KdaMoeVisionConfig(hidden_size=24, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        KdaMoeVisionConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_act"):
        KdaMoeVisionConfig(hidden_act="relu")
    with pytest.raises(ValueError, match="image_token_id"):
        KdaMoeConfig(image_token_id=10**6)
    with pytest.raises(ValueError, match="image_token_id"):
        KdaMoeConfig(image_token_id=2)  # the eos id
    assert KdaMoeVisionConfig.moonvit().hidden_size == 1152


def test_vision_tower_alone_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    tower = KdaMoeVisionModel(KdaMoeVisionConfig(hidden_size=32, num_attention_heads=2, patch_size=PATCH)).eval()
    tower.save_pretrained(tmp_path)
    reloaded = KdaMoeVisionModel.from_pretrained(tmp_path).eval()
    pixels, grids = patches(2, 2, 0), torch.tensor([[1, 2, 2]])
    with torch.no_grad():
        assert (tower(pixels, grids).pooler_output - reloaded(pixels, grids).pooler_output).abs().max() < 1e-6
