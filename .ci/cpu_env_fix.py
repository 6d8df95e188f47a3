"""Make PyPI's torchvision 0.28.0 importable beside the CPU build of torch 2.13.0.

Only the CPU environment (``make venv``) runs this. PyPI's torchvision wheel is a
CUDA build whose C++ ops cannot load next to a CPU torch, yet
``_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` unconditionally, and that fails with "operator
torchvision::nms does not exist", so ``import torchvision`` fails. vLLM's
Qwen2-VL code imports transformers' image processors, which import
torchvision's pure-Python transforms; they work once those two registrations
are made only when the ops loaded (as the file already does for every other
op). vLLM never calls nms. Idempotent.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPS = ("nms", "qnms")


def patch_text(text: str) -> str:
    """Turn each unconditional nms/qnms fake registration into a conditional one."""
    for op in OPS:
        plain = f'@torch.library.register_fake("torchvision::{op}")'
        guarded = (
            f'@(torch.library.register_fake("torchvision::{op}") '
            "if torchvision.extension._has_ops() else (lambda fn: fn))"
        )
        text = "\n".join(guarded if line == plain else line for line in text.split("\n"))
    return text


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("torchvision is not installed; nothing to patch")
        return 0
    return fix(Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py")


def fix(target: Path) -> int:
    """Patch `target` in place (0), or say in one line that its text is not the one this patch knows (1)."""
    before = target.read_text()
    after = patch_text(before)
    guarded = all(f'register_fake("torchvision::{op}") if torchvision.extension._has_ops()' in after for op in OPS)
    if not guarded:
        print(
            f"error: {target} has no unconditional nms/qnms fake registration to guard (another torchvision?); "
            "the patch does not apply, and `import torchvision` may fail",
            file=sys.stderr,
        )
        return 1
    if after != before:
        target.write_text(after)
    print(f"{'patched' if after != before else 'already patched'}: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
