"""Attention and Gaussian Nadaraya–Watson (NW) weights from queries and keys. Pure torch.

Everything here rests on one identity (paper §C.3): for any temperature ``tau = h**2``

    -|q - k_i|^2 / (2 tau) = q·k_i / tau - |k_i|^2 / (2 tau) - |q|^2 / (2 tau),

and the last term is the same for every key of a row, so a softmax drops it. Gaussian NW weights are therefore
dot-product attention logits plus a per-key bias ``-|k_i|^2 / (2 tau)`` (the *key-norm bias*). At the *matched*
bandwidth ``h**2 = sqrt(d_head)`` the two differ by that bias alone.

Per row, the NW ranks follow ``q·k - |k|^2/2`` and the attention ranks follow ``q·k``: rank statistics between them
do not depend on the bandwidth at all, only on the spread of the key norms.

Shapes: queries ``(..., Q, D)``, keys ``(..., K, D)``, logits and weights ``(..., Q, K)``.
"""

from __future__ import annotations

import math

import torch

from .rows import Segments

__all__ = [
    "QUERY_FRAME_FORMS",
    "contribution_sums",
    "dot_logits",
    "key_norm_bias",
    "matched_bandwidth",
    "merge_heads",
    "mix_tokens",
    "mixed_sums",
    "n_eff",
    "nw_logits",
    "nw_mean",
    "nw_weights",
    "orthonormal_coordinates",
    "projected_tokens",
    "query_frame_bias",
    "query_frame_terms",
    "reference_contributions",
    "reference_sums",
    "segment_query_frame_terms",
    "softmax_keys",
    "split_heads",
]

#: The two estimates of the query-frame key term (:func:`query_frame_bias`).
QUERY_FRAME_FORMS: tuple[str, ...] = ("exact", "gaussian")


def matched_bandwidth(head_dim: int) -> float:
    """The bandwidth ``h`` whose temperature ``h**2 = sqrt(head_dim)`` equals scaled dot-product attention's."""
    return head_dim**0.25


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Heads first: ``(B, ..., H*D)`` -> ``(B, H, N, D)``, the middle dimensions (images, tokens) folded into ``N``."""
    return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)  # (B, N, H, D) -> (B, H, N, D)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Heads back into the channels: ``(B, H, N, D)`` -> ``(B, N, H*D)``."""
    return x.transpose(1, 2).flatten(2)  # (B, N, H, D) -> (B, N, H*D)


def dot_logits(q: torch.Tensor, k: torch.Tensor, scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product logits ``scale * q k^T``, ``(..., Q, D)`` x ``(..., K, D)`` -> ``(..., Q, K)``; ``scale``
    (default ``1/sqrt(D)``, as in SDPA) a float or a tensor broadcastable to ``(..., 1, 1)``."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return (q @ k.transpose(-1, -2)) * scale


def key_norm_bias(k: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """The per-key bias ``-|k_i|^2 / (2 h^2)`` that turns dot-product logits into Gaussian logits: keys
    ``(..., K, D)``, bandwidth a float or broadcastable to ``(..., 1, 1)``; shape ``(..., 1, K)``, ready to add to
    ``(..., Q, K)`` logits or to pass as an SDPA float mask."""
    return -(k * k).sum(-1).unsqueeze(-2) / (2 * h * h)


def nw_logits(q: torch.Tensor, k: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """Gaussian NW logits ``-|q - k_i|^2 / (2 h^2)`` up to a per-row constant: ``(q·k_i - |k_i|^2/2) / h^2``.

    Queries and keys are first centred at the keys' mean (the weights are translation invariant), so float32 keeps
    its precision when the keys share a large common offset. Shapes as :func:`dot_logits`; their softmax over the
    last dimension is the NW weight matrix.
    """
    center = k.mean(-2, keepdim=True)  # (..., 1, D)
    q, k = q - center, k - center
    return dot_logits(q, k, 1.0 / (h * h)) + key_norm_bias(k, h)


def nw_weights(q: torch.Tensor, k: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """Gaussian NW weights ``w_i = softmax_i(-|q - k_i|^2 / (2 h^2))``, log-sum-exp stable. Shape ``(..., Q, K)``."""
    return torch.softmax(nw_logits(q, k, h), dim=-1)


def softmax_keys(logits: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``softmax`` over the last (key) dimension, ``(..., Q, K)``, computed on a ``(..., K, Q)`` copy when the rows
    are short on the CPU (a transposed view is returned there); a list of logits is stacked along a new first
    dimension in the layout the kernel reads (one copy, where a key-major stack was copied again by the kernel).

    torch's CPU kernel vectorises along the softmax's own dimension, which a row of a few image tokens cannot fill:
    measured on 2 cores for ``(2, 8, 4096, K)`` float32, 3.7 ms at ``K = 8`` along the last dimension against 0.3 ms
    along the other (copy included); from ``K = 16`` on the last dimension is the faster. Equal to ``torch.softmax``
    up to float rounding (the two kernels sum in different orders).
    """
    first = logits[0] if isinstance(logits, list) else logits
    if first.device.type != "cpu" or first.shape[-1] >= 16 or first.dim() < 2:
        return torch.softmax(torch.stack(logits) if isinstance(logits, list) else logits, dim=-1)
    by_key = torch.stack([x.mT for x in logits]) if isinstance(logits, list) else logits.mT.contiguous()
    return torch.softmax(by_key, dim=-2).transpose(-1, -2)


def query_frame_terms(
    logits: torch.Tensor,
    row_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    form: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query-frame key term ``b`` and the row-centred logits ``L``, whose difference ``L - b`` is the query-frame
    NW logits: Gaussian NW in the frame where the model's own queries are isotropic.

    With ``L_qi`` the row-centred logits of one head (``logits_qi - mean_j logits_qj`` over the kept keys ``j``), a
    query frame is the pool of rows ``q`` it is estimated over (one item's query positions at one step, say), and

        exact:     b_i = log mean_q exp(L_qi)
        gaussian:  b_i = mean_q L_qi + Var_q(L_qi) / 2      (population variance: the plug-in estimate)

    ``softmax_i(L_qi - b_i)`` is the NW weighting of row ``q``. For queries ``x ~ N(0, h^2 I)``,
    ``log E_x exp(x·y_i / h^2) = |y_i|^2 / (2 h^2)``: the key-norm term of Gaussian NW is the log-partition of the
    dot-product kernel over isotropic queries, and ``b_i`` is that log-partition taken over the model's own queries
    (``gaussian`` assumes them Gaussian, ``exact`` does not). ``b`` depends on the logits alone, so it is unchanged
    by any per-head basis change (``q -> A q``, ``k -> A^-T k``) and by any per-row shift of the logits.

    Args:
        logits: attention logits, shape ``(..., R, K)`` (the pool of rows is dimension ``-2``).
        row_mask: optional boolean ``(..., R)``: only these rows form the frame.
        key_mask: optional boolean broadcastable to ``(..., R, K)``: keys where it is False (padding) are left out of
            their row's centring, and ``b_i`` is taken over the frame's rows that keep key ``i`` (the same rows for
            every key when the mask is the same for every row of a pool); a key no row of the frame keeps has
            ``b = 0``.
        form: ``"exact"``, ``"gaussian"``, or ``"both"`` (both from one centring, stacked in the order of
            :data:`QUERY_FRAME_FORMS`).

    Returns:
        ``(L, b)`` in the logits' dtype: ``(..., R, K)`` (left-out keys 0) and ``(F, ..., 1, K)``, one entry of ``F``
        per form. Apart, so that a caller can take the rows it needs before subtracting
        (:func:`~ipa_probe.capture.cells.cell_inputs` takes its row sample of the centred rows); ``L - b`` from the
        centred logits gives a frame of one row exactly constant rows (uniform NW weights, no rank correlation), where
        ``logits - b`` would give float rounding noise.
    """
    # Worked key-major, (..., K, R): every reduction over the frame's rows then runs along the last dimension, which
    # is contiguous for the probe's logits (key-major views, see capture.cells.record_logits): a max over 4,096 rows
    # takes 16 us there against 745 us along a row-major tensor's outer dimension (2 CPU cores, (2, 8, 4096, 8)).
    by_key = logits.transpose(-1, -2)  # (..., K, R)
    if key_mask is None:
        centred = by_key - by_key.mean(-2, keepdim=True)
    else:
        key_mask = key_mask.to(torch.bool).expand(logits.shape).transpose(-1, -2)
        kept = key_mask.to(logits.dtype)
        row_mean = torch.where(key_mask, by_key, 0.0).sum(-2, keepdim=True) / kept.sum(-2, keepdim=True)
        centred = torch.where(key_mask, by_key - row_mean, 0.0)
    # key-major in memory (a copy only for row-major logits), so that the masked and the unmasked forms below reduce
    # in the same order: an all-rows mask gives bit-identical b
    centred = centred.contiguous()
    inside = None  # (..., 1, R) or (..., K, R): the frame's entries, per key
    if row_mask is not None:
        inside = row_mask.to(torch.bool).unsqueeze(-2)
    if key_mask is not None:
        inside = key_mask if inside is None else inside & key_mask

    reduce = (lambda x: x.amax(-1, keepdim=True), lambda x: x.sum(-1, keepdim=True), lambda x: x)
    b = _frame_key_terms(centred, inside, logits.shape[-2], form, reduce)  # (F, ..., K, 1)
    return centred.transpose(-1, -2), b.transpose(-1, -2)  # (..., R, K), (F, ..., 1, K)


def segment_query_frame_terms(
    logits: torch.Tensor, rows: Segments, row_mask: torch.Tensor, frames: Segments, form: str = "exact"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`query_frame_terms` of frames of any sizes in one pass, every reduction by segment: ``logits`` ``(N,)``
    rows of ``K`` entries without a key mask, ``rows`` each entry's row, ``row_mask`` ``(rows.cells,)`` the rows that
    form their frame, ``frames`` each entry's ``frame * K + key``. Returns ``(N,)`` the centred logits and ``b``
    ``(F, frames.cells)``."""
    keys = logits.shape[-1] // rows.cells
    centred = logits - rows.sum(logits).div_(keys).index_select(0, rows.ids)  # (N,)

    def peak(x: torch.Tensor) -> torch.Tensor:
        return x.new_full((frames.cells,), -math.inf).scatter_reduce_(0, frames.ids, x, "amax")

    reduce = (peak, frames.sum, lambda x: x.index_select(0, frames.ids))
    return centred, _frame_key_terms(centred, row_mask.index_select(0, rows.ids), None, form, reduce)


def _frame_key_terms(
    centred: torch.Tensor, inside: torch.Tensor | None, n_all: int | None, form: str, reduce: tuple
) -> torch.Tensor:
    """The key terms ``b`` of :func:`query_frame_terms` from the centred logits (key-major), stacked per form:
    ``reduce`` holds the frames' max and sum (``(..., S)`` -> ``(..., frames)``) and the way back from frames to
    entries; ``inside`` the frames' entries (``None`` for all: ``n_all`` of them)."""
    if form not in (*QUERY_FRAME_FORMS, "both"):
        raise ValueError(f"form: expected one of {(*QUERY_FRAME_FORMS, 'both')}, got {form!r}")
    forms, (peak_of, total, back) = QUERY_FRAME_FORMS if form == "both" else (form,), reduce
    if inside is None:
        n_rows = torch.full((), n_all, dtype=centred.dtype, device=centred.device)
    else:
        n_rows = total(inside.to(centred.dtype))  # (..., 1, 1), (..., K, 1) or (frames,)
    outside = ~inside if inside is not None else None
    # two working tensors of the logits' size, reused in place: the frame's terms (centred, left-out entries -inf, then
    # 0) and their deviations
    terms = centred if outside is None else centred.masked_fill(outside, -math.inf)
    out = {}
    if "exact" in forms:
        peak = peak_of(terms)  # -inf for a key no row of the frame keeps
        peak = torch.where(peak.isfinite(), peak, 0.0)
        work = torch.sub(terms, back(peak)).exp_()
        out["exact"] = total(work).log_().add_(peak) - torch.log(n_rows)
    if "gaussian" in forms:
        if outside is not None:
            terms = terms.masked_fill_(outside, 0.0)  # a copy of the centred logits (above)
        mean = total(terms) / n_rows
        dev = torch.sub(terms, back(mean), out=work) if "exact" in forms else terms - back(mean)
        if outside is not None:
            dev.masked_fill_(outside, 0.0)
        out["gaussian"] = mean + total(dev * dev) / (2 * n_rows)
    b = torch.stack([out[name] for name in forms])
    return b if inside is None else torch.where(n_rows > 0, b, 0.0)


def query_frame_bias(
    logits: torch.Tensor,
    row_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    form: str = "exact",
) -> torch.Tensor:
    """The query-frame key term ``b_i`` of :func:`query_frame_terms` (same arguments), shape ``(..., 1, K)``
    (``(2, ..., 1, K)`` for ``form="both"``): subtract it from the logits (or pass ``-b`` as an SDPA float mask) to
    get the query-frame NW logits up to a per-row constant."""
    b = query_frame_terms(logits, row_mask, key_mask, form)[1]
    return b if form == "both" else b[0]


def nw_mean(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The NW local mean ``m(q) = sum_i w_i v_i``: ``(..., Q, K) @ (..., K, Dv)``."""
    return weights @ values


def n_eff(weights: torch.Tensor) -> torch.Tensor:
    """Kish effective sample size ``1 / sum_i w_i^2`` of normalised weights ``(..., K)`` -> ``(...)``.

    1 means the weight sits on one key (nearest neighbour), ``K`` means uniform weights.
    """
    return 1.0 / (weights * weights).sum(-1)


def orthonormal_coordinates(vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` ``(..., X, C)`` as coordinates in an orthonormal basis of their span, ``(..., X, min(X, C))``.

    Every norm and dot product of linear combinations of the vectors is unchanged, so the per-reference contributions
    (combinations of ``X = R * H * T`` token vectors of ``C`` channels) are formed in ``X`` dimensions instead of
    ``C``: 64 against 320-1280 for SD 1.5 with two 4-token references. A Householder QR (``V^T = Q R``: row ``x`` of
    ``V`` has coordinates ``R[:, x]``), backward stable: float32's accuracy relative to the vectors' size. Only on the
    CPU and where ``X < C`` (on a GPU the full-width products are cheap and a batched QR is a solver call)."""
    if vectors.device.type != "cpu" or vectors.shape[-2] >= vectors.shape[-1]:
        return vectors
    return torch.linalg.qr(vectors.transpose(-1, -2), mode="r").R.transpose(-1, -2)


def reference_contributions(
    weights: torch.Tensor,
    values: torch.Tensor | list[torch.Tensor],
    tokens: int,
    scale: float | torch.Tensor,
    w_o: torch.Tensor | None,
    heads: bool = False,
    coordinates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each reference's contribution to an image branch's output as it enters the residual stream (the probe's maps
    and the ``contribution`` hook point): per reference ``j`` (its tokens ``i``), head ``h`` and query ``q``, with
    ``s`` the adapter scale and ``W_o`` ``(C, H * D)`` the weight of ``attn.to_out[0]`` without its bias (``None``:
    Flux's branch has none, ``C = H * D``), ``c_{j,h}(q) = s W_o[:, h] sum_{i in j} w_{h,i}(q) v_{h,i}``.

    Given ``weights`` ``(B, H, Q, K)`` (``K = R * T``, reference-major) and ``values`` ``(B, H, K, D)``, returns
    ``c_j = sum_h c_{j,h}`` ``(B, R, Q, C)`` and, with ``heads``, the ``c_{j,h}`` ``(B, H, R, Q, C)`` (Flux: head
    ``h``'s own block of ``C``, ``(B, H, R, Q, D)``), else ``None``; ``coordinates``: ``C`` in the tokens'
    :func:`orthonormal_coordinates` where that pays (for norms and dot products only). ``L`` layers at once:
    ``weights`` ``(L * B, ...)``, ``values`` a list of ``L``, ``w_o`` their ``(L, H, D, C)`` stack, ``scale`` ``(L,)``
    or a number."""
    values, (n_heads, queries, keys) = [values] if torch.is_tensor(values) else values, weights.shape[1:]
    if w_o is not None:
        coordinates = coordinates and _coordinates_pay(queries, w_o.shape[-1], n_heads * keys)
        return mix_tokens(weights, projected_tokens(values, tokens, scale, w_o, coordinates), heads)
    w = weights.reshape(-1, n_heads, queries, keys // tokens, tokens)  # (L * B, H, Q, R, T)
    v = values[0] if len(values) == 1 else torch.cat(values)
    v = v.reshape(v.shape[0], n_heads, keys // tokens, tokens, v.shape[-1])  # (L * B, H, R, T, D)
    per_head = torch.einsum("bhqrt,bhrtd->bhrqd", w, v)  # (L * B, H, R, Q, D)
    per_head = _scaled(per_head.unflatten(0, (len(values), -1)), scale).flatten(0, 1)
    return per_head.permute(0, 2, 3, 1, 4).flatten(-2), per_head if heads else None  # (L * B, R, Q, H * D)


def _coordinates_pay(queries: int, channels: int, vectors: int) -> bool:
    """Whether the QR of the ``X = H * K`` token vectors pays: where it shortens the queries' products by more than 4x
    its size (one CPU thread: at X = 512 it costs 2-4x what it saves at 16 x 16 latents)."""
    return queries * (channels - vectors) > 4 * channels * vectors


def reference_sums(weights, values, tokens: int, scale, w_o, heads: bool = False) -> tuple:
    """:func:`contribution_sums` of :func:`reference_contributions`' ``c_j`` in coordinates where they pay, and their
    ``c_{j,h}`` with ``heads``, else ``None`` (arguments as there). Without heads, with ``W_o``, on a CPU and where
    the queries outnumber 4x a reference's ``H * T`` vectors, from :func:`mixed_sums` (``c`` given as ``None``)."""
    values, (n_heads, queries, keys) = [values] if torch.is_tensor(values) else values, weights.shape[1:]
    mixed = w_o is not None and not heads and weights.device.type == "cpu" and queries >= 4 * n_heads * tokens
    if mixed and not _coordinates_pay(queries, w_o.shape[-1], n_heads * keys):
        return mixed_sums(weights, projected_tokens(values, tokens, scale, w_o)), None, None
    contributions, per_head = reference_contributions(weights, values, tokens, scale, w_o, heads, True)
    return *contribution_sums(contributions), per_head


def contribution_sums(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|c_j|``, ``c_j . c`` and ``|c|`` (``c = sum_j c_j``, taken once per query) of contributions ``c_j`` ``(..., R,
    Q, C)``, stacked ``(3, ..., R, Q)``; and ``c`` ``(..., 1, Q, C)``."""
    total = c.sum(-3, keepdim=True)
    norm = torch.linalg.vector_norm(total, dim=-1).expand(c.shape[:-1])
    return torch.stack([torch.linalg.vector_norm(c, dim=-1), torch.linalg.vecdot(c, total), norm]), total


def mixed_sums(weights: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
    """:func:`contribution_sums` of :func:`mix_tokens`' ``c_j`` without forming them (``R * Q * C`` values, most of
    the maps' CPU time at 64 reference tokens and 64 x 64 latents): ``c`` as one product over every token vector,
    ``c_j . c = sum_{i in j} w_i (p_i . c)`` from one product with ``c``, and ``|c_j|`` in an orthonormal basis of
    reference ``j``'s ``H * T`` vectors (a Householder QR: backward stable). Within float32 rounding of the formed
    sums (tests/test_contributions.py); ``weights`` ``(L * B, H, Q, K)``, ``projected`` ``(L * B, R, H, T, C)``."""
    batch, references, n_heads, tokens, channels = projected.shape
    w = weights.reshape(batch, n_heads, -1, references, tokens).permute(0, 2, 3, 1, 4).flatten(3)  # (L * B, Q, R, HT)
    p = projected.reshape(batch, -1, channels)  # (L * B, R * H * T, C)
    c = w.flatten(2) @ p  # (L * B, Q, C)
    dots = (w * (c @ p.transpose(1, 2)).unflatten(-1, (references, -1))).sum(-1).transpose(1, 2)  # (L * B, R, Q)
    basis = torch.linalg.qr(p.unflatten(1, (references, -1)).transpose(-1, -2), mode="r").R  # (L * B, R, HT, HT)
    norms = torch.linalg.vector_norm(w.transpose(1, 2) @ basis.transpose(-1, -2), dim=-1)
    return torch.stack([norms, dots, torch.linalg.vector_norm(c, dim=-1)[:, None].expand_as(norms)])


def projected_tokens(values: list[torch.Tensor], tokens: int, scale, w_o: torch.Tensor, coordinates=False):
    """Each token's value through ``W_o`` first, ``s W_o[:, h] v_{h,i}`` (``B * K * H`` vectors of ``C``, few; one
    product for the ``L`` layers), for :func:`mix_tokens`: ``(L * B, R, H, T, C)``, contiguous (arguments as in
    :func:`reference_contributions`; ``w_o`` one layer's ``(C, H * D)`` or the stack)."""
    (batch, n_heads, keys, _), v = values[0].shape, [x.transpose(0, 1).flatten(1, 2) for x in values]  # (H, B * K, D)
    if w_o.dim() == 2:
        w_o = w_o.to(v[0].dtype).unflatten(1, (n_heads, -1)).permute(1, 2, 0)[None]  # (1, H, D, C)
    projected = (v[0][None] if len(v) == 1 else torch.stack(v)) @ w_o  # (L, H, B * K, C)
    projected = _scaled(projected, scale).unflatten(2, (batch, keys // tokens, tokens))  # (L, H, B, R, T, C)
    projected = projected.permute(0, 2, 3, 1, 4, 5)  # (L, B, R, H, T, C)
    if coordinates:
        projected = orthonormal_coordinates(projected.flatten(2, 4)).unflatten(2, projected.shape[2:5])
    return projected.flatten(0, 1).contiguous()  # (L * B, R, H, T, C)


def mix_tokens(weights: torch.Tensor, projected: torch.Tensor, heads: bool = False) -> tuple:
    """One product per reference over its ``H * T`` (head, token) weights of the :func:`projected_tokens`: ``Q * H *
    T * C`` multiply-adds instead of ``Q * (H * D) * C`` through ``W_o`` after mixing (``T = 4`` tokens against ``D =
    40-160`` channels in SD); returns as :func:`reference_contributions`."""
    references, n_heads, tokens = projected.shape[1:4]
    w = weights.reshape(-1, n_heads, weights.shape[2], references, tokens)  # (L * B, H, Q, R, T)
    per_head = torch.einsum("bhqrt,brhtc->bhrqc", w, projected) if heads else None  # (L * B, H, R, Q, C)
    return torch.einsum("bhqrt,brhtc->brqc", w, projected), per_head  # (L * B, R, Q, C)


def _scaled(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x`` ``(L, ...)`` times a per-layer ``(L,)`` scale, or a number (``x`` itself at 1)."""
    if torch.is_tensor(scale):
        return x * scale.reshape(-1, *[1] * (x.dim() - 1))
    return x if scale == 1 else x * scale
