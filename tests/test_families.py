"""train/families/: what differs between model families is asked of the family, nowhere else decided."""

from __future__ import annotations

import pathlib
import re

import pytest

from train import families

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A family decided by its name, a config probed for a family's own field, a Tunix class tested, or a
# table keyed by family: each belongs in the family's module (issue 68).
FAMILY_KNOWLEDGE = re.compile(r"family ==|num_embed|issubclass\(.*Gemma3|attn_type|FAMILY_VOCAB_HASH|HF_BASE|ARCHITECTURES"
                              r"|\bSITES\b|use_tied_embedding|weight_tying")
ROOM = ("train", "families")


def family_knowledge_outside_the_room(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in {"tests", "build"} or rel.parts[:2] == ROOM or any(p.startswith(".") for p in rel.parts):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FAMILY_KNOWLEDGE.search(line):
                found.append(f"{rel.as_posix()}:{n}: {line.strip()}")
    return found


def test_no_family_is_decided_outside_the_family_room():
    assert family_knowledge_outside_the_room(ROOT) == []


def test_the_family_check_can_fail(tmp_path):
    (tmp_path / "train" / "step").mkdir(parents=True)
    (tmp_path / "train" / "families").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    probe = 'if hasattr(config, "num_embed"):\n    pass\n'
    (tmp_path / "train" / "step" / "loss.py").write_text(probe + 'if spec.family == "qwen3":\n    pass\n')
    (tmp_path / "train" / "families" / "gemma3.py").write_text(probe)  # the family's own module may
    (tmp_path / "tests" / "test_x.py").write_text(probe)
    assert family_knowledge_outside_the_room(tmp_path) == ['train/step/loss.py:1: if hasattr(config, "num_embed"):',
                                                           'train/step/loss.py:3: if spec.family == "qwen3":']


def test_every_model_names_its_family_and_each_family_is_found_by_its_classes():
    for spec in families.MODELS.values():
        assert spec.family in families.FAMILIES and spec.lora_module_path == spec.family.lora_paths
    for family in families.FAMILIES:
        assert families.by_name(family.name) is family
        assert families.of(family.model_class()) is family and families.of(family.attention_class()) is family
        tiny = next(s for s in families.MODELS.values() if s.family is family and s.tiny)
        config = tiny.make_config(100, tiny.default_dtype)
        assert families.of(config) is family and family.vocab_size(config) == 100
    with pytest.raises(ValueError, match="^int is of no model family here"):
        families.of(3)


def test_the_families_real_models_name_their_hugging_face_checkpoints():
    assert {name: s.hf_base for name, s in families.MODELS.items() if s.hf_base} == {
        "gemma3-270m": "google/gemma-3-270m", "gemma3-1b": "google/gemma-3-1b-pt", "qwen3-0.6b": "Qwen/Qwen3-0.6B",
        "tiny-llama3": "meta-llama/Llama-3.2-1B"}
