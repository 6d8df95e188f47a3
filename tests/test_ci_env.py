"""`.ci/cpu_env_fix.py`, the one patch of a third-party file: it guards torchvision's nms/qnms fake registrations,
does nothing to a file it patched, and fails in one line on a file whose text it does not know."""

from __future__ import annotations

import importlib.util

from tests.support.repo import REPO

PLAIN = '@torch.library.register_fake("torchvision::{op}")\ndef meta_{op}(*args):\n    pass\n'


def _module():
    spec = importlib.util.spec_from_file_location("cpu_env_fix", REPO / ".ci" / "cpu_env_fix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_patch_guards_both_registrations_once_and_refuses_a_file_it_does_not_know(tmp_path, capsys):
    fix = _module().fix
    target = tmp_path / "_meta_registrations.py"
    target.write_text("import torch\n" + "".join(PLAIN.format(op=op) for op in ("nms", "qnms")))
    assert fix(target) == 0 and capsys.readouterr().out.startswith("patched:")
    patched = target.read_text()
    assert patched.count("if torchvision.extension._has_ops() else (lambda fn: fn))") == 2
    assert fix(target) == 0 and capsys.readouterr().out.startswith("already patched:")
    assert target.read_text() == patched
    target.write_text("import torch\n# a torchvision whose registrations are written otherwise\n")
    assert fix(target) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "the patch does not apply" in err and err.count("\n") == 1
