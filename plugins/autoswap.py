"""The stock ColossalAI plugins replaced by dist_optim's drop-ins, for scripts that import them.

``apply()`` sets the plugin names of ``colossalai.booster.plugin`` (and of the submodules that
define them) to the classes of :mod:`dist_optim.plugins`, which subclass them: every later
``from colossalai.booster.plugin import HybridParallelPlugin`` gets ours, with the same
constructor, so that ``booster.boost`` swaps the optimizer, binds it to the real layouts and
saves it in the layout-independent checkpoint format, exactly as with our classes imported by
name. A class imported before ``apply()`` keeps the stock one: the launcher
(``python -m dist_optim.plugins.launch``) applies it as ColossalAI's plugins are first imported.
"""

from __future__ import annotations

import sys

__all__ = ["PLUGINS", "apply"]

#: Where ColossalAI 0.5.0 defines each plugin class that dist_optim.plugins replaces.
PLUGINS = {
    "HybridParallelPlugin": "colossalai.booster.plugin.hybrid_parallel_plugin",
    "MoeHybridParallelPlugin": "colossalai.booster.plugin.moe_hybrid_parallel_plugin",
    "LowLevelZeroPlugin": "colossalai.booster.plugin.low_level_zero_plugin",
    "TorchDDPPlugin": "colossalai.booster.plugin.torch_ddp_plugin",
    "GeminiPlugin": "colossalai.booster.plugin.gemini_plugin",
    "TorchFSDPPlugin": "colossalai.booster.plugin.torch_fsdp_plugin",
}


def apply() -> list[str]:
    """Replace the stock plugin classes in the loaded ColossalAI modules; returns what it set
    (idempotent: nothing the second time)."""
    import dist_optim.plugins as ours

    done = []
    for name, module in PLUGINS.items():
        mine = getattr(ours, name)
        for where in ("colossalai.booster.plugin", module):
            loaded = sys.modules.get(where)
            if loaded is not None and getattr(loaded, name, None) not in (None, mine):
                setattr(loaded, name, mine)
                done.append(f"{where}.{name}")
    return done
