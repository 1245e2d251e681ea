"""A small, readable float64 Shampoo/SOAP written directly from the papers' formulas (SOAP's
``eigenbasis="qr"``: Meta's DefaultSOAPConfig, from its source).

It shares no code with ``dist_optim``: one parameter at a time, full tensors, plain loops, roots
always by ``eigh`` (the iterative methods of the optimizer compute the same root inverse, so the
tests compare them against this with a looser tolerance). State is exposed with the optimizer's
key names (``block<i>.<name>``) so the two can be compared entry by entry.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch


def merged_shape(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Merge neighbouring dims while the product stays <= max_dim."""
    if all(d == 1 for d in shape):
        return (1,)
    out, cur = [], 1
    for d in shape:
        if cur * d <= max_dim:
            cur *= d
        else:
            if cur > 1:
                out.append(cur)
            cur = d
    if cur > 1:
        out.append(cur)
    return tuple(out)


def block_slices(shape: tuple[int, ...], max_dim: int) -> list[tuple[slice, ...]]:
    ranges = [[slice(a, min(a + max_dim, n)) for a in range(0, n, max_dim)] for n in shape]
    return list(itertools.product(*ranges))


def mode_product(x: torch.Tensor, mat: torch.Tensor, k: int) -> torch.Tensor:
    """(x ×_k mat)[..., i, ...] = sum_j mat[i, j] x[..., j, ...]."""
    moved = x.movedim(k, 0)
    out = torch.einsum("ij,j...->i...", mat, moved)
    return out.movedim(0, k)


def unfold_outer(g: torch.Tensor, k: int) -> torch.Tensor:
    """contract(G, G, all dims but k)."""
    gk = g.movedim(k, 0).reshape(g.shape[k], -1)
    return gk @ gk.T


def eig_desc(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues/vectors, decreasing order, each column's largest-magnitude entry positive."""
    lam, q = torch.linalg.eigh(a)
    lam, q = lam.flip(0), q.flip(1)
    for j in range(q.shape[1]):
        if q[q[:, j].abs().argmax(), j] < 0:
            q[:, j] = -q[:, j]
    return lam, q


def root_inverse(a: torch.Tensor, eps: float, exponent: float) -> torch.Tensor:
    """Q diag(lam^-exponent) Q^T of A + eps I, eigenvalues shifted up to at least eps."""
    n = a.shape[0]
    lam, q = torch.linalg.eigh(a + eps * torch.eye(n, dtype=a.dtype))
    if lam.min() < eps:
        lam = lam + (eps - lam.min())
    return q @ torch.diag(lam ** (-exponent)) @ q.T


def qr_algorithm_refresh(a: torch.Tensor, q: torch.Tensor, eps: float) -> torch.Tensor:
    """Meta's DefaultSOAPConfig refresh (QREigendecompositionConfig(max_iterations=1), read in
    facebookresearch/optimizers' matrix_functions.qr_algorithm): B = Q^T (A + eps I) Q,
    Q'R = qr(B), Q <- Q Q', columns in increasing order of diag(R Q') (stable sort), signs as
    the QR gives them. Meta skips the QR when B is exactly diagonal; its QR is then Q' = I anyway."""
    b = q.T @ (a + eps * torch.eye(a.shape[0], dtype=a.dtype)) @ q
    qb, r = torch.linalg.qr(b)
    estimates = torch.diagonal(r @ qb)
    return (q @ qb)[:, torch.argsort(estimates, stable=True)]


def qr_power_refresh(a: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vyas et al.'s refresh after their first (eigh) one: sort Q's columns by diag(Q^T A Q)
    (decreasing), then B = Q^T A Q, Q'R = qr(B), Q <- Q Q' with R's diagonal made positive.
    Returns (new Q, the sort permutation)."""
    order = torch.argsort(torch.diagonal(q.T @ a @ q), descending=True, stable=True)
    q = q[:, order]
    b = q.T @ a @ q
    qb, r = torch.linalg.qr(b)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q @ (qb * signs), order


class ReferenceShampoo:
    """The algorithm on float64 copies of the parameters.

    ``graft``: None or a tuple ``(kind, beta2, eps)`` with kind in sgd/adagrad/rmsprop/adam.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        use_nesterov: bool = False,
        use_bias_correction: bool = True,
        use_decoupled_weight_decay: bool = True,
        graft: tuple[str, float, float] | None = None,
        eigenvalue_correction: bool = False,
        eigenbasis: str = "eigh",
        merge_small_dims: bool = False,
        exponent_override: float = 0,
        exponent_multiplier: float = 1.0,
        kl_statistics: bool = False,
    ) -> None:
        self.kl = kl_statistics
        self.params = [p.detach().double().clone() for p in params]
        self.lr, self.b1, self.b2 = lr, betas[0], betas[1]
        self.eps, self.mom, self.wd = epsilon, momentum, weight_decay
        self.max_dim, self.pf = max_preconditioner_dim, precondition_frequency
        start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
        self.start = max(start, 1)
        self.nesterov, self.bc, self.decoupled = use_nesterov, use_bias_correction, use_decoupled_weight_decay
        self.graft, self.soap, self.basis_mode = graft, eigenvalue_correction, eigenbasis
        self.merge, self.override, self.mult = merge_small_dims, exponent_override, exponent_multiplier
        self.state: list[dict[str, Any]] = [{} for _ in self.params]
        #: The smallest gap between neighbouring eigenvalues of a factor whose eigenvectors became a
        #: SOAP basis (:func:`eig_desc`), relative to its largest eigenvalue: where it is ~0 (a
        #: repeated eigenvalue, e.g. the null space of a rank-deficient factor) the basis within
        #: that eigenspace is LAPACK's choice and SOAP's update depends on it, so no reference can
        #: pin the result down.
        self.min_eigen_gap = float("inf")

    def _view(self, p: torch.Tensor) -> tuple[int, ...]:
        shape = tuple(p.shape) or (1,)
        return merged_shape(shape, self.max_dim) if self.merge else shape

    def step(self, grads: list[torch.Tensor | None]) -> None:
        for i, (w, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            g = g.detach().double().clone()
            st = self.state[i]
            st["step"] = st.get("step", 0) + 1
            t = st["step"]
            if self.wd and not self.decoupled:
                g = g + self.wd * w
            view = self._view(w)
            gv = g.reshape(view)
            update = torch.zeros(view, dtype=torch.float64)
            for b, sl in enumerate(block_slices(view, self.max_dim)):
                update[sl] = self._block(st, f"block{b}.", gv[sl].clone(), t)
            update = update.reshape(w.shape)
            if self.wd and self.decoupled:
                update = update + self.wd * w
            if self.mom:
                buf = st.get("momentum_buffer", torch.zeros_like(w))
                buf = self.mom * buf + update
                st["momentum_buffer"] = buf
                update = update + self.mom * buf if self.nesterov else buf
            w -= self.lr * update

    def _get(self, st: dict[str, Any], key: str, like: torch.Tensor) -> torch.Tensor:
        if key not in st:
            st[key] = torch.zeros_like(like)
        return st[key]

    def _block(self, st: dict[str, Any], key: str, g: torch.Tensor, t: int) -> torch.Tensor:
        mhat, d = self._moments(st, key, g, t)
        self._factors(st, key, g, t)
        st.setdefault(key + "failures", 0.0)
        refresh = t == self.start or (t > self.start and t % self.pf == 0)
        corr = (1 - self.b2**t) if (self.bc and self.b2 < 1) else 1.0
        if self.soap:
            return self._soap(st, key, g, t, mhat, d, refresh, corr)
        return self._shampoo(st, key, g, t, mhat, d, refresh, corr)

    def _moments(self, st: dict[str, Any], key: str, g: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``Mhat`` and the grafting direction ``D``."""
        b1 = self.b1
        if b1 > 0:
            m = b1 * self._get(st, key + "exp_avg", g) + (1 - b1) * g
            st[key + "exp_avg"] = m
            mhat = m / (1 - b1**t) if self.bc else m
        else:
            mhat = g
        if self.graft is None or self.graft[0] == "sgd":
            return mhat, mhat
        kind, gb2, geps = self.graft
        v = self._get(st, key + "graft_sq", g)
        v = v + g**2 if kind == "adagrad" else gb2 * v + (1 - gb2) * g**2
        st[key + "graft_sq"] = v
        vhat = v / (1 - gb2**t) if kind == "adam" else v
        return mhat, mhat / (vhat.sqrt() + geps)

    def _factors(self, st: dict[str, Any], key: str, g: torch.Tensor, t: int) -> None:
        b2 = self.b2
        inverses = self._kl_soap_inverses(st, key, g, t) if self.kl and self.soap else None
        for k in range(g.dim()):
            x = g
            if inverses is not None:  # KL-SOAP: G_(k) (x_{j != k} S_j^-1) G_(k)^T / prod_{j != k} d_j
                y = g
                for j in range(g.dim()):
                    if j != k:
                        y = mode_product(y, inverses[j], j) / g.shape[j]
                stat = g.movedim(k, 0).reshape(g.shape[k], -1) @ y.movedim(k, 0).reshape(g.shape[k], -1).T
            else:
                if self.kl:  # KL-Shampoo (Lin et al. 2025): G along the other dims by their current roots
                    for j in range(g.dim()):
                        if j != k:
                            x = mode_product(x, st.get(f"{key}root{j}", torch.eye(g.shape[j], dtype=torch.float64)), j)
                stat = unfold_outer(x, k)
            f = self._get(st, f"{key}factor{k}", torch.empty(g.shape[k], g.shape[k], dtype=torch.float64))
            f = f + stat if b2 == 1 else b2 * f + (1 - b2) * stat
            st[f"{key}factor{k}"] = f

    def _kl_soap_inverses(self, st: dict[str, Any], key: str, g: torch.Tensor, t: int) -> list[torch.Tensor]:
        """KL-SOAP (Lin et al. 2025): each factor's inverse as SOAP knows it before this step's
        statistics, ``S_j^-1 = Q_j diag(lam_j)^-1 Q_j^T`` in the basis of the last refresh (the
        identity before the first), ``lam_j = max(diag(Q_j^T A_j Q_j), eps)`` of the bias-corrected
        factor ``A_j``; the identity at the first step, before any statistics."""
        out = []
        for j in range(g.dim()):
            n = g.shape[j]
            if t == 1:
                out.append(torch.eye(n, dtype=torch.float64))
                continue
            q = st.get(f"{key}basis{j}", torch.eye(n, dtype=torch.float64))
            corr = (1 - self.b2 ** (t - 1)) if (self.bc and self.b2 < 1) else 1.0
            lam = torch.diagonal(q.T @ (st[f"{key}factor{j}"] / corr) @ q).clamp(min=self.eps)
            out.append(q @ torch.diag(1 / lam) @ q.T)
        return out

    def _graft(self, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return p * d.norm() / (p.norm() + 1e-16) if self.graft is not None else p

    def _shampoo(
        self,
        st: dict[str, Any],
        key: str,
        g: torch.Tensor,
        t: int,
        mhat: torch.Tensor,
        d: torch.Tensor,
        refresh: bool,
        corr: float,
    ) -> torch.Tensor:
        order = g.dim()
        for k in range(order):
            st.setdefault(f"{key}root{k}", torch.eye(g.shape[k], dtype=torch.float64))
            if refresh:
                r = self.override or 2 * order
                st[f"{key}root{k}"] = root_inverse(st[f"{key}factor{k}"] / corr, self.eps, self.mult / r)
        if t < self.start:
            return d
        p = mhat
        for k in range(order):
            p = mode_product(p, st[f"{key}root{k}"], k)  # roots are symmetric
        return self._graft(p, d)

    def _soap(
        self,
        st: dict[str, Any],
        key: str,
        g: torch.Tensor,
        t: int,
        mhat: torch.Tensor,
        d: torch.Tensor,
        refresh: bool,
        corr: float,
    ) -> torch.Tensor:
        b2, eps = self.b2, self.eps
        s = self._get(st, key + "exp_avg_sq", g)
        for k in range(g.dim()):
            st.setdefault(f"{key}basis{k}", torch.eye(g.shape[k], dtype=torch.float64))
            if refresh:
                a = st[f"{key}factor{k}"] / corr
                if self.basis_mode == "qr":  # S is not permuted: Meta's keeps it per column
                    st[f"{key}basis{k}"] = qr_algorithm_refresh(a, st[f"{key}basis{k}"], eps)
                elif self.basis_mode in ("eigh", "eigh-ascending") or t == self.start:
                    lam, st[f"{key}basis{k}"] = eig_desc(a)
                    if self.basis_mode == "eigh-ascending":  # Meta's order; the gap below is alike
                        st[f"{key}basis{k}"] = st[f"{key}basis{k}"].flip(1)
                    if lam.numel() > 1:
                        gap = float((lam[:-1] - lam[1:]).min() / lam.abs().max().clamp(min=1e-300))
                        self.min_eigen_gap = min(self.min_eigen_gap, gap)
                else:  # "qr-eigh-start"
                    st[f"{key}basis{k}"], perm = qr_power_refresh(a, st[f"{key}basis{k}"])
                    s = s.index_select(k, perm)
        qs = [st[f"{key}basis{k}"] for k in range(g.dim())]

        def rotate(x: torch.Tensor) -> torch.Tensor:  # x ×_k Q_k^T
            for k, q in enumerate(qs):
                x = mode_product(x, q.T, k)
            return x

        def unrotate(x: torch.Tensor) -> torch.Tensor:  # x ×_k Q_k
            for k, q in enumerate(qs):
                x = mode_product(x, q, k)
            return x

        gr = rotate(g)
        s = s + gr**2 if b2 == 1 else b2 * s + (1 - b2) * gr**2
        st[key + "exp_avg_sq"] = s
        shat = s / (1 - b2**t) if (self.bc and b2 < 1) else s
        return self._graft(unrotate(rotate(mhat) / (shat.sqrt() + eps)), d)
