"""Model cards: `save_pretrained` writes a card that parses as a Hub model card (text and multimodal models), states a
license only when one is given, and `push_to_hub` uploads that card (not transformers' generic one) in a folder that
loads with the Auto classes (no network: the Hub calls of `push_to_hub` are replaced by local stand-ins)."""

import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import tiny_model
from huggingface_hub import ModelCard
from multimodal_testing import tiny_multimodal_model


def test_saved_card_validates_and_describes_the_model(tmp_path):
    from kda_moe import KdaMoeForCausalLM
    from kda_moe.model_cards import GENERATED_MARK, parameter_counts

    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path / "my-kda-moe")
    card = ModelCard.load(tmp_path / "my-kda-moe" / "README.md", ignore_metadata_errors=False)  # strict YAML parse
    # The metadata the Hub's validator checks: library and pipeline tag, list-valued tags; no license was given.
    assert card.data.license is None and "No license is stated for this model." in card.text
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "kda-moe" in card.data.tags and "mixture-of-experts" in card.data.tags
    assert card.content.startswith("---\n") and GENERATED_MARK in card.text
    counts = parameter_counts(model)
    assert counts["total"] == model.num_parameters() and counts["active"] < counts["total"]
    assert f"{counts['total']:,}" in card.text
    assert "3 KDA + 2 gated MLA" in card.text and "8 routed (top-2) + 1 shared" in card.text
    assert "Block AttnRes, block size 2" in card.text
    # Both ways to load: the bundled source (no kda_moe needed) and the installed package.
    assert 'AutoModelForCausalLM.from_pretrained("my-kda-moe", trust_remote_code=True)' in card.text
    assert "import kda_moe" in card.text and 'AutoModelForCausalLM.from_pretrained("my-kda-moe")' in card.text
    assert "## License" in card.text and "## Intended use" in card.text
    # A model built on the meta device (no memory) gives the same counts; a config is refused with that recipe.
    with torch.device("meta"):
        assert parameter_counts(KdaMoeForCausalLM(model.config)) == counts
    with pytest.raises(TypeError, match="meta device"):
        parameter_counts(model.config)


def test_card_states_a_license_only_when_given_and_keeps_it_when_written_again(tmp_path):
    from kda_moe.model_cards import write_model_card

    model = tiny_model(seed=0)
    write_model_card(model, tmp_path, license="mit")
    card = ModelCard.load(tmp_path / "README.md", ignore_metadata_errors=False)
    assert card.data.license == "mit" and "The model is released under `mit`." in card.text
    model.save_pretrained(tmp_path)  # writes the card again
    assert ModelCard.load(tmp_path / "README.md").data.license == "mit"
    write_model_card(model, tmp_path, license="apache-2.0")
    assert ModelCard.load(tmp_path / "README.md").data.license == "apache-2.0"


def test_evaluation_results_become_the_model_index_and_survive_saving_again(tmp_path):
    from huggingface_hub import EvalResult

    from kda_moe.model_cards import write_model_card

    model = tiny_model(seed=0)
    folder = tmp_path / "evaluated"
    model.save_pretrained(folder)
    assert "Not evaluated yet" in (folder / "README.md").read_text() and "model-index" not in (folder / "README.md").read_text()
    results = [EvalResult(task_type="multiple-choice", dataset_type="kda_long_context_passkey",
                          dataset_name="pass-key retrieval", dataset_config=str(length), metric_type="accuracy",
                          metric_value=value) for length, value in ((4096, 0.85), (65536, 0.4))]  # fmt: skip
    write_model_card(model, folder, eval_results=results, license="apache-2.0")
    model.save_pretrained(folder)  # saving again keeps the results and the license
    card = ModelCard.load(folder / "README.md", ignore_metadata_errors=False)
    assert card.data.model_name == "evaluated" and card.data.license == "apache-2.0"
    assert [(r.dataset_config, r.metric_value) for r in card.data.eval_results] == [("4096", 0.85), ("65536", 0.4)]
    assert "| pass-key retrieval | 4096 | accuracy | 0.850 |" in card.text and "Not evaluated yet" not in card.text


def test_multimodal_folder_gets_a_card_of_its_own(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK, parameter_counts

    model = tiny_multimodal_model(seed=0)
    model.save_pretrained(tmp_path / "my-vlm")
    card = ModelCard.load(tmp_path / "my-vlm" / "README.md", ignore_metadata_errors=False)
    assert GENERATED_MARK in card.text and card.data.pipeline_tag == "image-text-to-text" and card.data.license is None
    assert 'AutoModelForImageTextToText.from_pretrained("my-vlm", trust_remote_code=True)' in card.text
    assert 'AutoProcessor.from_pretrained("my-vlm", trust_remote_code=True)' in card.text
    assert "| vision tower | 2 layers, hidden 32, 2 heads, 4x4 patches" in card.text
    assert "3 KDA + 2 gated MLA" in card.text
    counts = parameter_counts(model)
    assert counts["total"] == model.num_parameters() and f"{counts['total']:,}" in card.text


def test_card_someone_else_wrote_is_kept(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# my own card\n")
    tiny_model(seed=0).save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "---\nlicense: mit\n---\n# my own card\n"
    tiny_model(seed=0).save_pretrained(tmp_path / "again")
    (tmp_path / "again" / "README.md").write_text((tmp_path / "again" / "README.md").read_text() + "stale line\n")
    tiny_model(seed=0).save_pretrained(tmp_path / "again")  # our own card is refreshed in place
    assert "stale line" not in (tmp_path / "again" / "README.md").read_text()


REPO_ID = "someone/tiny-kda-moe"


def _capture_push(push, folder: Path, hub_card: str | None = None) -> None:
    """Run `push()` (a `push_to_hub` or `save_pretrained(..., push_to_hub=True)` call) with the Hub replaced: the repo
    exists, its card is `hub_card` (None: it has none yet), and the commit copies the files transformers'
    `_upload_modified_files` hands it to `folder` instead of sending them."""
    import transformers.modeling_utils as modeling_utils
    import transformers.utils.hub as hub
    from huggingface_hub.errors import EntryNotFoundError

    def load_card(repo_id, *args, **kwargs):
        if hub_card is None:
            raise EntryNotFoundError("no README.md in the repository yet")
        return ModelCard(hub_card)

    def commit(repo_id, operations, **kwargs):
        assert repo_id == REPO_ID
        for operation in operations:
            target = folder / operation.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(operation.path_or_fileobj, target)

    api = mock.Mock()
    api.create_repo.return_value = mock.Mock(repo_id=REPO_ID)
    api.create_commit.side_effect = commit
    with (
        mock.patch.object(hub, "hf_api", return_value=api),
        mock.patch.object(modeling_utils, "hf_api", return_value=api),  # save_pretrained(push_to_hub=True)'s repo
        mock.patch.object(hub.ModelCard, "load", side_effect=load_card),
    ):
        push()
    api.create_commit.assert_called_once()


def test_push_to_hub_folder_loads_with_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = tiny_model(seed=1)
    model.train()
    input_ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids, labels=input_ids).loss.backward()  # non-zero Quantile Balancing biases travel too
    model.eval()
    _capture_push(lambda: model.push_to_hub(REPO_ID), tmp_path / "upload")
    files = {p.name for p in (tmp_path / "upload").iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "generation_config.json"} <= files
    assert {"configuration_kda_moe.py", "modeling_kda_moe.py", "remote_code.py"} <= files  # the bundled source
    config = AutoConfig.from_pretrained(tmp_path / "upload")
    assert config.model_type == "kda_moe_text"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "upload").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    assert type(AutoModel.from_pretrained(tmp_path / "upload")).__name__ == "KdaMoeTextModel"
    ModelCard.load(tmp_path / "upload" / "README.md", ignore_metadata_errors=False)


def test_push_to_hub_uploads_the_generated_card_with_the_push_tags(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK, TAGS

    _capture_push(lambda: tiny_model(seed=1).push_to_hub(REPO_ID, tags=["my-tag"]), tmp_path / "upload")
    card = ModelCard.load(tmp_path / "upload" / "README.md", ignore_metadata_errors=False)
    assert GENERATED_MARK in card.text and f'from_pretrained("{REPO_ID}")' in card.text  # named after the repo
    assert "# tiny-kda-moe" in card.text and "3 KDA + 2 gated MLA" in card.text
    assert card.data.license is None and card.data.pipeline_tag == "text-generation"
    assert card.data.tags == TAGS + ["my-tag"]


def test_save_pretrained_with_push_to_hub_uploads_the_generated_card(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK

    model = tiny_model(seed=1)
    push = lambda: model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id=REPO_ID)  # noqa: E731
    _capture_push(push, tmp_path / "upload")
    uploaded = (tmp_path / "upload" / "README.md").read_text()
    assert GENERATED_MARK in uploaded and f'from_pretrained("{REPO_ID}")' in uploaded
    assert (tmp_path / "local" / "README.md").read_text() == uploaded  # the folder keeps what was uploaded


def test_push_to_hub_refreshes_our_card_on_the_hub_and_keeps_a_card_someone_wrote(tmp_path):
    from kda_moe.model_cards import GENERATED_MARK, model_card

    model = tiny_model(seed=1)
    ours_on_the_hub = model_card(
        model, model_id=REPO_ID, tags=["earlier-tag"], training_summary="an older run", license="mit"
    )
    _capture_push(lambda: model.push_to_hub(REPO_ID, tags=["my-tag"]), tmp_path / "ours", hub_card=str(ours_on_the_hub))
    card = ModelCard.load(tmp_path / "ours" / "README.md", ignore_metadata_errors=False)
    assert GENERATED_MARK in card.text and "an older run" not in card.text  # regenerated: ours while the mark is there
    assert {"earlier-tag", "my-tag", "kda-moe"} <= set(card.data.tags) and card.data.license == "mit"

    theirs = "---\nlicense: mit\n---\n# my own card\n"
    _capture_push(lambda: model.push_to_hub(REPO_ID, tags=["my-tag"]), tmp_path / "theirs", hub_card=theirs)
    card = ModelCard.load(tmp_path / "theirs" / "README.md", ignore_metadata_errors=False)
    assert card.data.license == "mit" and card.text.strip() == "# my own card" and card.data.tags == ["my-tag"]
