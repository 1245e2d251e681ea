"""The old name of ``recipes/train.py``, kept working: the recipe now trains Llama, Mistral, Qwen2
and Mixtral models. ``python recipes/train_llama.py ...`` (or under torchrun / ``colossalai run``)
runs ``recipes/train.py`` with the same arguments, and ``import recipes.train_llama`` is the same
module object as ``recipes.train``."""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    runpy.run_path(os.path.join(ROOT, "recipes", "train.py"), run_name="__main__")
else:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from recipes import train

    sys.modules[__name__] = train
