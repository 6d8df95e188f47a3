"""`pipeline.devkit.phrasings`: captions of synth's grid scenes in other words, whose spans say what each names."""

from __future__ import annotations

import numpy as np

from pipeline.devkit import synth
from pipeline.devkit.phrasings import POSITIONS, phrased_caption


def test_each_mention_spans_its_object_and_its_colour_word_and_no_phrasing_is_synths():
    synth_positions = {
        synth.where_phrase(synth.Obj(r, c, "circle", "red", "small", "solid"), style, 4)
        for r in range(4)
        for c in range(4)
        for style in range(4)
    }
    seen_colours, placed, unplaced = 0, 0, 0
    for i in range(300):
        rng = np.random.default_rng([9, i])
        objs = synth.draw_scene(rng, 4)
        if not objs:
            continue
        caption = phrased_caption(objs, rng)
        assert not caption.text.startswith(("There is ", "A grid scene")), caption.text
        assert not any(where in caption.text for where in synth_positions), caption.text
        assert 1 <= len(caption.mentions) <= min(4, len(objs))
        for mention, colour in zip(caption.mentions, caption.colour_spans):
            phrase = caption.text[mention.start : mention.end]
            assert mention.obj.shape in phrase
            if colour is not None:
                assert mention.start <= colour[0] < colour[1] <= mention.end
                assert caption.text[colour[0] : colour[1]] == mention.obj.colour
                seen_colours += 1
            assert mention.class_named == (colour is not None)
            if mention.cell_named:
                assert any(where(mention.obj).lower() in phrase.lower() for where in POSITIONS), phrase
                placed += 1
            else:
                unplaced += 1
    assert seen_colours > 100 and placed > 100 and unplaced > 20, (seen_colours, placed, unplaced)
