"""`--prompts FILE`: the formats a prompt file may take, and a one-line refusal for each way one can be wrong."""

from __future__ import annotations

import json

import pytest

from captioning.prompts import DEFAULT_PROMPTS, Prompt, load_prompts
from pipeline.core.errors import UserError


def test_no_file_gives_the_default_prompts():
    assert load_prompts(None) == list(DEFAULT_PROMPTS) and len({p.id for p in DEFAULT_PROMPTS}) == 4


def test_text_lines_json_and_yaml_lists_give_the_same_prompts(tmp_path):
    (tmp_path / "p.txt").write_text("  Describe the scene.\n\nWhat is on the left?  \n")
    (tmp_path / "p.json").write_text(
        json.dumps(["Describe the scene.", {"id": "left", "text": " What is on the left? "}])
    )
    (tmp_path / "p.yaml").write_text("- Describe the scene.\n- id: left\n  text: What is on the left?\n")
    assert load_prompts(tmp_path / "p.txt") == [
        Prompt("p0", "Describe the scene."),
        Prompt("p1", "What is on the left?"),
    ]
    expected = [Prompt("p0", "Describe the scene."), Prompt("left", "What is on the left?")]
    assert load_prompts(tmp_path / "p.json") == load_prompts(tmp_path / "p.yaml") == expected


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("absent.txt", None, "no such file"),
        ("bad.json", "[1, ", "cannot parse"),
        ("bad.yaml", "- a\n b: [", "cannot parse"),
        ("map.json", '{"text": "x"}', "expected a list of prompts"),
        ("blank.json", '[{"id": "a", "text": "  "}]', "entry 0 needs a non-empty 'text'"),
        ("number.yaml", "- 7\n", "entry 0 needs a non-empty 'text'"),
        ("empty.txt", "\n\n", "no prompts"),
        ("twice.json", '[{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]', "prompt ids must be unique"),
    ],
)
def test_a_bad_prompt_file_is_refused_in_one_line(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=needle) as caught:
        load_prompts(path)
    assert str(caught.value).startswith(f"--prompts {path}: ") and "\n" not in str(caught.value)
