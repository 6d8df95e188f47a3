import json

import numpy as np
from PIL import Image

from pipeline.devkit import dataset, synth
from tests.support.commands import refused, tcjepa


def test_synth_files_labels_and_captions(synth_dir):
    caps = [json.loads(line) for line in (synth_dir / "captions.jsonl").read_text().splitlines()]
    labels = [json.loads(line) for line in (synth_dir / "labels.jsonl").read_text().splitlines()]
    meta = json.loads((synth_dir / "classes.json").read_text())
    assert len(caps) == len(labels) == 40
    for c, lab in zip(caps, labels):
        assert c["image"] == lab["image"]
        assert len(c["captions"]) == 8 and all(t.strip() for t in c["captions"])
        img = np.asarray(Image.open(synth_dir / c["image"]))
        assert img.shape == (64, 64, 3)
        assert lab["cell_size"] * len(lab["cells"]) == 64
        names = meta["cell_classes"]
        for r, row in enumerate(lab["cells"]):
            for col, cls in enumerate(row):
                block = img[r * 16 : (r + 1) * 16, col * 16 : (col + 1) * 16].astype(int)
                spread = block.max(axis=(0, 1)) - block.min(axis=(0, 1))
                if cls == 0:
                    assert spread.max() < 60, "an empty cell is only noisy background"
                else:
                    colour, shape = names[cls].split(" ")
                    assert spread.max() > 60, "a shape stands out from the background"
                    # every caption names the object (its colour and shape words are in each caption)
                    assert all(colour in t and shape in t for t in c["captions"])
        assert lab["label"] in meta["image_labels"]


def test_synth_labels_carry_the_shape_map_and_the_pairs_present(synth_dir):
    meta = json.loads((synth_dir / "classes.json").read_text())
    names, shapes = meta["cell_classes"], meta["cell_maps"]["shape"]
    assert shapes == ["empty", *synth.SHAPES] and meta["tags"] == names[1:] and len(meta["tags"]) == 40
    for line in (synth_dir / "labels.jsonl").read_text().splitlines():
        lab = json.loads(line)
        classes = [c for row in lab["cells"] for c in row]
        shape_ids = [s for row in lab["cell_maps"]["shape"] for s in row]
        assert [shapes[s] for s in shape_ids] == ["empty" if c == 0 else names[c].split(" ")[1] for c in classes]
        assert lab["tags"] == [names[c] for c in sorted(set(classes) - {0})]


def test_synth_deterministic_and_prefix_stable(tmp_path):
    tcjepa("synth", "--out", tmp_path / "a", "--n-images", 5, "--seed", 1)
    tcjepa("synth", "--out", tmp_path / "b", "--n-images", 8, "--seed", 1, fresh=True)  # another hash seed
    tcjepa("synth", "--out", tmp_path / "c", "--n-images", 5, "--seed", 2)
    a = (tmp_path / "a" / "captions.jsonl").read_text().splitlines()
    b = (tmp_path / "b" / "captions.jsonl").read_text().splitlines()
    c = (tmp_path / "c" / "captions.jsonl").read_text().splitlines()
    assert a == b[:5] and a != c
    for i in range(5):
        name = f"images/{i:06d}.png"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_synth_other_sizes(tmp_path):
    tcjepa("synth", "--out", tmp_path, "--n-images", 3, "--image-size", 96, "--grid", 3)
    lab = json.loads((tmp_path / "labels.jsonl").read_text().splitlines()[0])
    assert lab["cell_size"] == 32 and len(lab["cells"]) == 3
    assert Image.open(tmp_path / lab["image"]).size == (96, 96)


def test_synth_rejects_bad_sizes(tmp_path):
    proc = refused("synth", "--out", tmp_path, "--n-images", 3, "--image-size", 65)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "multiple of --grid" in proc.stderr


def test_every_caption_phrasing_names_positions():
    rng = np.random.default_rng(0)
    objs = synth.draw_scene(rng, 4)
    caps = synth.captions_for(objs, 4, rng)
    assert len(set(caps)) == 8
    for c in caps:
        assert any(w in c for w in ("row", "position", "top", "bottom", "middle"))


def test_partial_captions_name_a_few_objects_some_loosely_and_say_so_in_their_spans():
    import numpy as np

    seen = {"loose": 0, "exact": 0, "shape_or_colour_only": 0}
    for i in range(40):
        rng = np.random.default_rng([7, i])
        objs = synth.draw_scene(rng, 4)
        if not objs:
            continue
        full = synth.scene_captions(objs, 4, np.random.default_rng([7, i, 1]), "full")
        partial = synth.scene_captions(objs, 4, rng, "partial")
        assert len(partial) == 8 and all(len(c.mentions) == len(objs) for c in full)
        for caption in partial:
            assert 1 <= len(caption.mentions) <= min(3, len(objs))
            assert len({m.obj for m in caption.mentions}) == len(caption.mentions)
            for m in caption.mentions:
                phrase = caption.text[m.start : m.end].lower()
                o = m.obj
                assert o.shape in phrase or o.colour in phrase, phrase
                assert m.class_named == (o.shape in phrase and o.colour in phrase), phrase
                exact = any(phrase.endswith(synth.where_phrase(o, s, 4).lower()) for s in range(4))
                assert m.cell_named == exact, phrase
                seen["exact" if exact else "loose"] += 1
                seen["shape_or_colour_only"] += not m.class_named
    assert min(seen.values()) > 20, seen
    for i in range(5):  # deterministic
        a = synth.captions_for(
            synth.draw_scene(np.random.default_rng([1, i]), 4), 4, np.random.default_rng(i), "partial"
        )
        b = synth.captions_for(
            synth.draw_scene(np.random.default_rng([1, i]), 4), 4, np.random.default_rng(i), "partial"
        )
        assert a == b


def test_synth_writes_the_caption_mode_and_refuses_an_unknown_one(tmp_path):
    import json

    import pytest

    from pipeline.core.errors import UserError

    dataset.generate(tmp_path / "p", 3, captions="partial")
    assert json.loads((tmp_path / "p" / "classes.json").read_text())["captions"] == "partial"
    with pytest.raises(UserError, match="choose full or partial"):
        dataset.generate(tmp_path / "x", 3, captions="some")


def test_free_scenes_label_the_object_on_top_at_each_cell_centre(tmp_path):
    """`--layout free`: the label of each 8 px cell is the class of the object drawn on top at its centre, which
    the rendered pixel there shows (the object's colour, or its darker texture shade); the image label is a shape;
    captions name objects and regions; the same seed gives the same bytes."""
    from pipeline.devkit import free_scenes

    out = tmp_path / "free"
    tcjepa("synth", "--out", out, "--n-images", 12, "--layout", "free", "--captions", "full")
    meta = json.loads((out / "classes.json").read_text())
    assert meta["layout"] == "free" and meta["grid"] == 8 and meta["image_labels"] == list(synth.SHAPES)
    names = meta["cell_classes"]
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    captions = [json.loads(line)["captions"] for line in (out / "captions.jsonl").read_text().splitlines()]
    objects = 0
    for lab, caps in zip(labels, captions):
        img = np.asarray(Image.open(out / lab["image"])).astype(int)
        assert lab["label"] in synth.SHAPES and lab["cell_size"] == 8 and len(lab["cells"]) == 8
        for r, row in enumerate(lab["cells"]):
            for c, cls in enumerate(row):
                if cls == 0:
                    continue
                objects += 1
                colour, shape = names[cls].split(" ")
                assert lab["cell_maps"]["shape"][r][c] == 1 + synth.SHAPES.index(shape)
                pixel = img[r * 8 + 4, c * 8 + 4]
                full = np.array(synth.COLOURS[colour])
                assert np.abs(pixel - full).max() <= 1 or np.abs(pixel - np.clip(full * 0.45, 0, 255)).max() <= 1
        assert all(names[0] not in tag for tag in lab["tags"])
        assert any(
            f"at the {region}" in " ".join(caps)
            for region in (
                "top left",
                "centre",
                "bottom right",
                "left",
                "right",
                "top",
                "bottom",
                "top right",
                "bottom left",
            )
        )
        assert all(len(caps) == 8 and text.strip() for text in caps)
    assert objects > 12 * 5, "objects cover a share of the cells"
    again = tmp_path / "again"
    free_scenes_first = (out / "images" / "000003.png").read_bytes()
    tcjepa("synth", "--out", again, "--n-images", 4, "--layout", "free", "--captions", "full", fresh=True)
    assert (again / "images" / "000003.png").read_bytes() == free_scenes_first
    assert free_scenes.LABEL_GRID == 8
    bad = refused("synth", "--out", tmp_path / "x", "--n-images", 2, "--layout", "spiral")
    assert "--layout 'spiral': choose grid or free" in bad.stderr
