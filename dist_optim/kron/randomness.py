"""Everything of a Kron step that must come out the same on every rank without communicating:
the probe generators, the balancing draw and the counters of the update decision.

Probes (Li 2015's ``V``): with ``probe_rng="sequential"`` (kron_torch's stream) one
``torch.Generator`` per device seeded with ``seed``, drawn for every parameter with a gradient in
``param_groups`` order on every rank (non-owners draw and discard) so that every rank's stream
stays in step; with ``"per_parameter"`` each probe from a generator seeded by ``(seed, parameter
key, parameter step)``, the same whatever subset of the model an optimizer holds (pipeline
stages). The balancing draw comes from ``random.Random(seed)`` once per step, as kron_torch draws
it (kron_torch: always ``random.Random(42)``; identical for the default seed). The stochastic
rounding of 8-bit factors (:mod:`dist_optim.kron.state`) draws from a generator seeded by
``("round", seed, parameter key, parameter step)``, whatever ``probe_rng``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import torch

from .options import PROBE_RNGS
from .schedule import threshold
from .variant import cumulative_decision

__all__ = ["KronRandomness", "BALANCE_PROBABILITY", "keyed_generator", "param_position"]

#: kron_torch rescales the factors to a common max-abs on update steps where a draw is below this.
BALANCE_PROBABILITY = 0.01


class KronRandomness:
    """The generators and step counters of one optimizer; :meth:`state` / :meth:`load_state` are
    its part of the optimizer's ``extra_state`` (with full states, the same trajectory resumes
    under any layout)."""

    def __init__(self, seed: int, probe_rng: str) -> None:
        self.seed = seed
        self.probe_rng = probe_rng
        self.prob_step = 0
        self.update_counter = 0
        #: ``variant="heavyball"``: the running sum of the probabilities (:mod:`.variant`).
        self.cumulative = 0.0
        self.balance_rng = random.Random(seed)
        self.generators: dict[torch.device, torch.Generator] = {}

    @property
    def probe_rng(self) -> str:
        """``"sequential"`` or ``"per_parameter"`` (see the module docstring)."""
        return self._probe_rng

    @probe_rng.setter
    def probe_rng(self, value: str) -> None:
        if value not in PROBE_RNGS:
            raise ValueError(f"probe_rng must be one of {PROBE_RNGS}, got {value!r}")
        self._probe_rng = value

    def generator(self, device: torch.device) -> torch.Generator:
        """The sequential stream of ``device`` (made and seeded at first use)."""
        gen = self.generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self.generators[device] = gen
        return gen

    def probe_generator(self, device: torch.device, key: Callable[[], str], step: int) -> torch.Generator:
        """The generator of one probe: the sequential stream, or one seeded by ``(seed, key(),
        step)`` (``key`` is asked only then)."""
        if self.probe_rng == "sequential":
            return self.generator(device)
        return keyed_generator(device, f"{self.seed}|{key()}|{step}")

    def rounding_generator(self, device: torch.device, key: str, step: int) -> torch.Generator:
        """The generator of one parameter's stochastic rounding of its factors at ``step``
        (:mod:`dist_optim.kron.state`), seeded by ``("round", seed, key, step)`` whatever
        ``probe_rng``: a pure function of the parameter, not of the layout or of any stream, so
        every layout rounds alike and a resumed run needs no more state."""
        return keyed_generator(device, f"round|{self.seed}|{key}|{step}")

    def decide(self, prob: Any, cumulative: bool = False) -> tuple[bool, bool]:
        """(update the preconditioners?, balance them first?) for this step, from the update
        probability (a number or a callable of the step count); advances the counters and the
        balancing draw, the same on every rank. ``cumulative``: heavyball's rule
        (:func:`.variant.cumulative_decision`, the callable asked at the 1-based step)."""
        if cumulative:
            self.prob_step += 1
            do_update, self.cumulative = cumulative_decision(self.cumulative, prob, self.prob_step)
            return do_update, self.balance_rng.random() < BALANCE_PROBABILITY and do_update
        if callable(prob):
            prob = prob(self.prob_step)
        limit = threshold(prob)
        self.update_counter += 1
        do_update = self.update_counter >= limit
        if do_update:
            self.update_counter = 0
        self.prob_step += 1
        balance = self.balance_rng.random() < BALANCE_PROBABILITY and do_update
        return do_update, balance

    def state(self) -> dict[str, Any]:
        """The counters and the generator states (under the keys checkpoints hold)."""
        return {
            "prob_step": self.prob_step,
            "update_counter": self.update_counter,
            "cumulative": self.cumulative,
            "balance_rng": self.balance_rng.getstate(),
            "generators": {str(d): g.get_state() for d, g in self.generators.items()},
        }

    def load_state(self, extra: dict[str, Any]) -> None:
        """Inverse of :meth:`state`."""
        self.prob_step = int(extra["prob_step"])
        self.update_counter = int(extra["update_counter"])
        self.cumulative = float(extra.get("cumulative", 0.0))  # absent from checkpoints before it
        self.balance_rng.setstate(extra["balance_rng"])
        for name, st in extra["generators"].items():
            self.generator(torch.device(name)).set_state(st)


def keyed_generator(device: torch.device, text: str) -> torch.Generator:
    """A generator on ``device`` seeded by the first 63 bits (little-endian) of the 8-byte BLAKE2b
    digest of ``text`` (UTF-8)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def param_position(param_groups: list[dict[str, Any]], p: torch.Tensor) -> str:
    """``"<group index>.<index in its group>"``: a parameter's key where it has no name."""
    for gi, group in enumerate(param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return f"{gi}.{pi}"
    raise KeyError("parameter is not in this optimizer")
