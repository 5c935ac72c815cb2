"""Feature rows: the columns of a statement row (:data:`FEATURE_NAMES`,
documented in ``docs/features.md``) and the arithmetic that computes them
from a :class:`~mlir_ansor.search.features.reader.Structure` and its
quantities, as arrays over a population (:func:`program_features`), or for
one scheduled module read directly (:func:`features_of_module`).
"""

from __future__ import annotations

import numpy as np

from mlir_ansor.search.features.reader import COMPUTE_CATS, Structure, read_program

# --------------------------------------------------------------------------
# Feature names (the columns of a statement row). docs/features.md lists them.

MAX_BUFFERS = 5
"""Buffers described per statement (the ones with the most bytes)."""
AI_POINTS = 10
"""Samples of the arithmetic-intensity curve."""
CACHE_LINE = 64

_BUFFER_FEATURES = (
    "is_read",
    "is_write",
    "is_read_write",
    "bytes",
    "unique_bytes",
    "lines",
    "unique_lines",
    "reuse_loop",
    "reuse_serial",
    "reuse_none",
    "reuse_dis_iter",
    "reuse_dis_bytes",
    "reuse_ct",
    "bytes_d_reuse_ct",
    "unique_bytes_d_reuse_ct",
    "lines_d_reuse_ct",
    "unique_lines_d_reuse_ct",
    "stride",
)

FEATURE_NAMES: tuple[str, ...] = (
    *(f"{c}_ops" for c in COMPUTE_CATS),
    "flops",
    "vec_len",
    "vec_bytes",
    "vec_num",
    "vec_prod",
    "unroll_num",
    "unroll_len",
    "innermost_trip",
    "parallel_num",
    "parallel_prod",
    "parallel_len",
    "parallel_pos",
    "inside_parallel",
    "num_loops",
    "outer_prod",
    "outermost_trip",
    "num_buffers",
    "alloc_size",
    "alloc_num",
    "alloc_prod",
    "writes_alloc",
    "program_alloc_size",
    "linalg_ops",
    *(f"buf{b}_{n}" for b in range(MAX_BUFFERS) for n in _BUFFER_FEATURES),
    *(f"ai_curve_{i}" for i in range(AI_POINTS)),
)
"""Column names of a statement row, in order."""
N_FEATURES = len(FEATURE_NAMES)
_COL = {n: i for i, n in enumerate(FEATURE_NAMES)}


# --------------------------------------------------------------------------
# Features from a structure and quantities (arrays over a population).


def _log(x: np.ndarray) -> np.ndarray:
    return np.log2(1.0 + np.maximum(x, 0.0))


def program_features(st: Structure, q: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Feature rows of `n` programs that share structure `st`; `q` maps each
    quantity name to an array of shape (n,). Returns (n, statements, F)."""
    one = np.ones(n)
    get = lambda name, default=0.0: q.get(name, default * one)  # noqa: E731
    trips = {ax.id: np.maximum(get(f"{ax.id}.trip", 1.0), 1.0) for ax in st.axes}
    kinds = {ax.id: ax.kind for ax in st.axes}
    shapes = {b: [get(f"shape.{b}.{j}", 1.0) for j in range(r)] for b, r in st.buffers}
    elsizes = {a.buf: a.elsize for a in st.allocs}
    alloc_bytes = {}
    for a in st.allocs:
        sz = np.prod(np.stack(shapes[a.buf]), axis=0) * a.elsize if a.rank else a.elsize * one
        alloc_bytes[a.buf] = sz
    program_alloc = sum(alloc_bytes.values(), 0 * one)
    out = np.zeros((n, max(1, len(st.statements)), N_FEATURES))
    for si, s in enumerate(st.statements):
        f = out[:, si, :]
        axes = s.axes
        tr = [trips[a] for a in axes]
        iters = np.prod(np.stack(tr), axis=0) if tr else one
        flops_iter = 0 * one
        for cat in COMPUTE_CATS:
            if cat in s.cats:
                lanes = get(f"{s.id}.{cat}.lanes")
                f[:, _COL[f"{cat}_ops"]] = _log(lanes * iters)
                if cat in ("fma",):
                    flops_iter = flops_iter + 2 * lanes
                elif cat in ("addsub", "mul", "div", "math"):
                    flops_iter = flops_iter + lanes
        if s.linalg:
            flops_iter = flops_iter + get(f"{s.id}.linalg")
            f[:, _COL["linalg_ops"]] = _log(get(f"{s.id}.linalg") * iters)
        f[:, _COL["flops"]] = _log(flops_iter * iters)
        vw = get(f"{s.id}.vw", 1.0)
        elsize = max((a.elsize for a in s.accesses), default=4)
        f[:, _COL["vec_len"]] = vw
        f[:, _COL["vec_bytes"]] = vw * elsize
        vec_ops = sum((get(f"{s.id}.{c}.n") for c in s.cats if c in ("fma", "addsub", "mul", "div", "cmp", "math")), 0 * one)
        f[:, _COL["vec_num"]] = _log(np.where(vw > 1, vec_ops, 0))
        f[:, _COL["vec_prod"]] = _log(np.where(vw > 1, vec_ops * vw * iters, 0))
        rep = get(f"{s.id}.rep", 1.0)
        f[:, _COL["unroll_num"]] = rep
        inner = tr[-1] if tr else one
        f[:, _COL["unroll_len"]] = _log(rep * inner)
        f[:, _COL["innermost_trip"]] = _log(inner)
        # Parallel (scf.forall) dimensions and where they sit.
        live = [t > 1 for t in tr]
        n_live = sum(live, 0 * one)
        par = [i for i, a in enumerate(axes) if kinds[a] == "forall"]
        pprod = np.prod(np.stack([tr[i] for i in par]), axis=0) if par else one
        f[:, _COL["parallel_num"]] = sum((live[i] for i in par), 0 * one)
        f[:, _COL["parallel_prod"]] = _log(pprod)
        f[:, _COL["parallel_len"]] = _log(tr[par[-1]]) if par else 0
        if par:
            before = sum((live[i] for i in range(par[0])), 0 * one)
            f[:, _COL["parallel_pos"]] = before / np.maximum(n_live, 1)
            f[:, _COL["inside_parallel"]] = (pprod > 1).astype(float)
        f[:, _COL["num_loops"]] = n_live
        f[:, _COL["outer_prod"]] = _log(iters)
        outermost = 0 * one
        for t in reversed(tr):  # the outermost loop of more than one iteration
            outermost = np.where(t > 1, t, outermost)
        f[:, _COL["outermost_trip"]] = _log(outermost)
        # Allocations in scope: those made in a body that encloses this one.
        in_scope = [a for a in st.allocs if a.axes == axes[: len(a.axes)]]
        if in_scope:
            f[:, _COL["alloc_size"]] = _log(sum((alloc_bytes[a.buf] for a in in_scope), 0 * one))
            f[:, _COL["alloc_num"]] = len(in_scope)
            times = [np.prod(np.stack([trips[x] for x in a.axes]), axis=0) if a.axes else one for a in in_scope]
            f[:, _COL["alloc_prod"]] = _log(sum(times, 0 * one))
        f[:, _COL["writes_alloc"]] = float(any(a.write and a.buf in elsizes for a in s.accesses))
        f[:, _COL["program_alloc_size"]] = _log(program_alloc)
        f[:, _COL["num_buffers"]] = len(s.accesses)
        # Buffers: footprints at every loop level (innermost first).
        levels = len(axes) + 1
        per_buf = []
        total_unique = [0 * one for _ in range(levels)]
        for a in s.accesses:
            rank = a.rank
            shape = shapes.get(a.buf, [one] * rank)
            coef = {(j, ax): get(f"{a.q}.c{j}.{ax}") for j, ax in a.coeffs}
            spans = [get(f"{a.q}.span{j}", 1.0) for j in range(rank)]
            uniq = []  # unique elements at level L (loops L.. inside), L = len(axes) .. 0
            lines_l = []
            cur = list(spans)
            for lvl in range(len(axes), -1, -1):
                if lvl < len(axes):
                    ax = axes[lvl]
                    for j in range(rank):
                        if (j, ax) in coef:
                            cur[j] = cur[j] + coef[(j, ax)] * (trips[ax] - 1)
                capped = [np.minimum(c, s_) for c, s_ in zip(cur, shape)] if rank else []
                u = np.prod(np.stack(capped), axis=0) if rank else one
                ln = (np.prod(np.stack(capped[:-1]), axis=0) if rank > 1 else one) * np.ceil(
                    (capped[-1] if rank else one) * a.elsize / CACHE_LINE
                )
                uniq.append(u)
                lines_l.append(ln)
            for li in range(levels):
                total_unique[li] = total_unique[li] + uniq[li] * a.elsize
            nacc = get(f"{a.q}.n", 1.0)
            el = get(f"{a.q}.el", 1.0)
            bytes_ = el * a.elsize * iters
            avg = el / np.maximum(nacc, 1)
            lines = nacc * iters * np.maximum(1, np.ceil(avg * a.elsize / CACHE_LINE))
            ub, ul = uniq[-1] * a.elsize, lines_l[-1]
            # Reuse: the innermost loop (of more than one iteration) whose
            # index does not move this buffer.
            found = np.zeros(n, bool)
            dis_iter = 0 * one
            dis_bytes = 0 * one
            reuse_ct = 0 * one
            inner_iters = one.copy()
            for k in range(len(axes) - 1, -1, -1):
                ax = axes[k]
                moves = any(c_ax == ax for _, c_ax in a.coeffs)
                hit = (~found) & (trips[ax] > 1) & (not moves)
                lvl_index = len(axes) - 1 - k  # uniq index of the level inside ax
                dis_iter = np.where(hit, inner_iters, dis_iter)
                dis_bytes = np.where(hit, uniq[lvl_index] * a.elsize, dis_bytes)
                reuse_ct = np.where(hit, trips[ax], reuse_ct)
                found |= hit
                inner_iters = inner_iters * trips[ax]
            serial = (~found) & a.read & a.write
            stride = 0 * one
            got = np.zeros(n, bool)
            row = [np.prod(np.stack(shape[j + 1 :]), axis=0) if j + 1 < rank else one for j in range(rank)]
            for k in range(len(axes) - 1, -1, -1):
                ax = axes[k]
                s_ = sum((coef[(j, ax)] * row[j] for j in range(rank) if (j, ax) in coef), 0 * one)
                hit = (~got) & (trips[ax] > 1) & (s_ > 0)
                stride = np.where(hit, s_, stride)
                got |= hit
            ct = np.maximum(reuse_ct, 1)
            vals = {
                "is_read": float(a.read and not a.write) * one,
                "is_write": float(a.write and not a.read) * one,
                "is_read_write": float(a.read and a.write) * one,
                "bytes": _log(bytes_),
                "unique_bytes": _log(ub),
                "lines": _log(lines),
                "unique_lines": _log(ul),
                "reuse_loop": found.astype(float),
                "reuse_serial": serial.astype(float),
                "reuse_none": (~found & ~serial).astype(float),
                "reuse_dis_iter": _log(dis_iter),
                "reuse_dis_bytes": _log(dis_bytes),
                "reuse_ct": _log(reuse_ct),
                "bytes_d_reuse_ct": _log(bytes_ / ct),
                "unique_bytes_d_reuse_ct": _log(ub / ct),
                "lines_d_reuse_ct": _log(lines / ct),
                "unique_lines_d_reuse_ct": _log(ul / ct),
                "stride": _log(stride),
            }
            per_buf.append((bytes_, vals))
        if per_buf:
            order_key = np.stack([b for b, _ in per_buf], axis=1)  # (n, B)
            order = np.argsort(-order_key, axis=1, kind="stable")[:, :MAX_BUFFERS]
            for name in _BUFFER_FEATURES:
                mat = np.stack([v[name] for _, v in per_buf], axis=1)
                picked = np.take_along_axis(mat, order, axis=1)
                for b in range(picked.shape[1]):
                    f[:, _COL[f"buf{b}_{name}"]] = picked[:, b]
        # Arithmetic intensity at each level, sampled at AI_POINTS points
        # evenly spaced over log2(flops).
        fl = []
        acc_it = one.copy()
        for li in range(levels):
            if li > 0:
                acc_it = acc_it * trips[axes[len(axes) - li]]
            fl.append(flops_iter * acc_it)
        xs = np.stack([_log(x) for x in fl], axis=1)  # (n, levels), non-decreasing
        ys = np.stack([fl[li] / np.maximum(total_unique[li], 1) for li in range(levels)], axis=1)
        f[:, _COL["ai_curve_0"] : _COL["ai_curve_0"] + AI_POINTS] = _sample_curve(xs, ys, AI_POINTS)
    return out


def _sample_curve(xs: np.ndarray, ys: np.ndarray, k: int) -> np.ndarray:
    """Piecewise-linear y(x) per row, sampled at k points evenly spaced over
    (0, max x]; y before the first point is the first y."""
    n, m = xs.shape
    pts = xs[:, -1:] * (np.arange(1, k + 1) / k)[None, :]  # (n, k)
    out = np.repeat(ys[:, :1], k, axis=1)
    for i in range(1, m):
        x0, x1 = xs[:, i - 1 : i], xs[:, i : i + 1]
        y0, y1 = ys[:, i - 1 : i], ys[:, i : i + 1]
        w = np.clip((pts - x0) / np.maximum(x1 - x0, 1e-9), 0.0, 1.0)
        seg = y0 + w * (y1 - y0)
        out = np.where(pts > x0, seg, out)
    return out


# --------------------------------------------------------------------------
# One scheduled module, read directly.


def features_of_module(module) -> np.ndarray:
    """Features of one scheduled module read directly (no template): the
    reference the template path is checked against."""
    st, vals = read_program(module)
    q = {k: np.array([float(v)]) for k, v in vals.items()}
    return program_features(st, q, 1)[0]
