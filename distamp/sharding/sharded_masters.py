"""One rank's slice of the optimizer: FP32 masters, FP32 gradients and the inner optimizer's pieces.

With ``strategy.sharding`` each rank owns a balanced contiguous slice of the
flat parameter space (:mod:`distamp.core.flat_layout`) and keeps, for that
slice only:

* the FP32 values the inner optimizer updates: in O2 a flat FP32 buffer
  (the masters), in O1 and with AMP off views of the FP32 model parameters
  themselves;
* the reduced gradient: a flat buffer
  (:class:`~distamp.sharding.slice_grads.SliceGrads`), in FP32 ("main
  grad", as Megatron-LM calls it) or in O2 without gradient merge in the
  model's 16-bit dtype, summed into by the reduce-scatter during backward
  (stages 1 and 2), or filled from the model's ``.grad`` at step time when
  no data-parallel model reduces;
* one ``nn.Parameter`` per piece, a 1-D view of both, which is what the
  inner optimizer's param groups hold, so its state is the slice's too.

After an applied step the slices are all-gathered into every rank's model
parameters (:mod:`distamp.sharding.param_gather`).

The object offers the attributes and methods of
:class:`~distamp.core.master_weights.MasterWeights` that the meta-optimizer
and the data-parallel wrapper use, so they need not know about sharding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from distamp.core.chunked_update import adopt_written_values
from distamp.core.flat_layout import FlatLayout, Piece
from distamp.core.master_weights import clear_grads
from distamp.sharding.direct_gather import DirectGather
from distamp.sharding.pairwise import drop_storage
from distamp.sharding.param_gather import GatherInFlight, SliceAllGather
from distamp.sharding.slice_grads import SliceGrads
from distamp.torch_compat import tensor_version

__all__ = ["ShardedMasters"]


class ShardedMasters:
    """The pieces of the flat parameter space this rank updates.

    Example::

        masters = ShardedMasters(model.parameters(), torch.bfloat16, group, rank, world_size)
        inner = torch.optim.AdamW(model.parameters())
        masters.install(inner)           # inner's groups now hold this rank's pieces
        ...backward (gradients reduce-scattered into masters.grads)...
        masters.grads.collect()          # my slice of the gradients
        inner.step()
        masters.refresh_model()          # all-gather: every rank's model is updated

    Args:
        params: the model parameters, in the optimizer's order.
        low_dtype: the 16-bit dtype for O2, or ``None`` (O1, AMP off).
        group: the data-parallel group (``None`` in a one-process world).
        rank: this process's rank in ``group``.
        world_size: the number of ranks in ``group``.
        chunk_bytes: at most this many bytes per all-gather round.
        grad_dtype: the gradient slice's dtype: FP32, or in O2 without
            gradient merge ``low_dtype`` (see :mod:`distamp.sharding.slice_grads`).

    Raises:
        TypeError: a parameter of another dtype than FP32 (or, in O2, the
            low dtype), or parameters on more than one device.
        ValueError: a parameter that is not contiguous.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        low_dtype: torch.dtype | None,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        chunk_bytes: int = 25 * 2**20,
        grad_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.low_dtype = low_dtype
        self.model_params: list[nn.Parameter] = list(dict.fromkeys(params))  # distinct, by identity
        _check_params(self.model_params, low_dtype)
        self.group, self.rank = group, rank
        self.layout = FlatLayout([p.numel() for p in self.model_params], world_size)
        self.lo, self.hi = self.layout.range_of(rank)
        self.pieces: list[Piece] = self.layout.pieces(self.lo, self.hi)
        self.device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self.values: torch.Tensor | None = None
        self.pending: list[torch.Tensor] | None = None  # O2, several ranks: the start values until the broadcast
        self._index = {id(p): i for i, p in enumerate(self.model_params)}
        self.groups: list[list[int]] = [list(range(len(self.model_params)))]  # set by install()
        self._keep_fp32: set[int] = set()
        if low_dtype is not None:
            self._build_masters(world_size)
        self.masters: list[nn.Parameter] = [self._make_piece(piece) for piece in self.pieces]
        self.grads = SliceGrads(self.model_params, self.pieces, self.masters, self.lo, self.hi, grad_dtype)
        self.gather = SliceAllGather(self.layout, rank, group, chunk_bytes)
        self._refreshing: GatherInFlight | DirectGather | None = None
        # O2: each model parameter's version counter when it last held its masters' values (adopt_model_writes).
        self._versions: dict[int, int] = {}
        if low_dtype is not None:
            self.convert_model()
            self._versions = {i: tensor_version(p) for i, p in enumerate(self.model_params)}

    # ------------------------------------------------------------------ construction
    def _build_masters(self, world_size: int) -> None:
        originals = [p.detach() for p in self.model_params]
        self.values = torch.empty(self.hi - self.lo, dtype=torch.float32, device=self.device)
        for piece in self.pieces:
            start = piece.offset - self.lo
            source = originals[piece.param].reshape(-1)[piece.start : piece.stop]
            self.values[start : start + piece.length].copy_(source)
        # Every rank must start from rank 0's exact values, but after the conversion to 16 bits only this
        # rank's slice is left in FP32: keep the original tensors (no copy) until the start-up broadcast.
        self.pending = originals if world_size > 1 else None

    def _make_piece(self, piece: Piece) -> nn.Parameter:
        model_p = self.model_params[piece.param]
        start = piece.offset - self.lo
        if self.values is not None:
            data = self.values[start : start + piece.length]
        else:
            data = model_p.detach().view(-1)[piece.start : piece.stop]
        return nn.Parameter(data, requires_grad=model_p.requires_grad)

    # ------------------------------------------------------------------ MasterWeights surface
    @property
    def enabled(self) -> bool:
        """True in O2 (16-bit model, FP32 masters), as for :class:`MasterWeights`."""
        return self.low_dtype is not None

    @property
    def world_size(self) -> int:
        """Number of slices (ranks)."""
        return self.layout.world_size

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace each param group's parameters by this rank's pieces of them (possibly none).

        Groups keep their count and options, so LR schedulers work. State the
        inner optimizer already has is sliced the same way.

        Raises:
            ValueError: the optimizer's parameters are not the ones given here.
        """
        by_param: dict[int, list[int]] = {}
        for j, piece in enumerate(self.pieces):
            by_param.setdefault(piece.param, []).append(j)
        old_state = dict(optimizer.state)
        optimizer.state.clear()
        self.groups = []
        for group in optimizer.param_groups:
            pieces, members = [], []
            for p in group["params"]:
                index = self._index.get(id(p))
                if index is None:
                    raise ValueError(f"parameter of shape {tuple(p.shape)} is not managed by this optimizer")
                members.append(index)
                pieces.extend(by_param.get(index, []))
            self.groups.append(members)
            group["params"][:] = [self.masters[j] for j in pieces]  # in place: some optimizers keep the list
            for j in pieces:
                model_p = self.model_params[self.pieces[j].param]
                saved = old_state.get(model_p)
                if saved:
                    optimizer.state[self.masters[j]] = _slice_state(saved, self.pieces[j], model_p.numel())

    def master_for(self, param: nn.Parameter) -> nn.Parameter:
        """Not available under sharding: a parameter may have zero, one or two pieces on this rank."""
        raise RuntimeError(
            "with strategy.sharding a parameter's FP32 master is split across ranks; use "
            "optimizer.fp32_state_dict(model) (collective) for whole FP32 values"
        )

    def add(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Refused: the flat space is laid out once, when the optimizer is built.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(
            "add_param_group() is not supported with strategy.sharding: the flat parameter space is cut "
            "into slices when the optimizer is built. Pass every param group to the inner optimizer's "
            "constructor instead"
        )

    def convert_model(self, keep_fp32: Iterable[nn.Parameter] = ()) -> int:
        """O2: store each model parameter in the low dtype, or in FP32 if it is in ``keep_fp32``.

        Values come from exact FP32 values: the start values before the
        broadcast, else the masters (all-gathered when several ranks hold
        them: collective then). Returns how many parameters changed dtype.
        """
        self.finish_refresh()
        if self.low_dtype is None:
            return 0
        self._keep_fp32 |= {id(p) for p in keep_fp32}
        changing = [i for i, p in enumerate(self.model_params) if p.dtype != self._dtype_for(i)]
        if not changing:
            return 0
        exact = self._exact_values(changing)
        with torch.no_grad():
            for i in changing:
                p = self.model_params[i]
                p.data = exact[i].view_as(p).to(self._dtype_for(i), copy=True)
                self._versions[i] = tensor_version(p)
        return len(changing)

    def adopt_model_writes(self) -> int:
        """O2: copy into this rank's masters the parts of model parameters written since they held their values.

        As :meth:`distamp.core.master_weights.MasterWeights.adopt_model_writes`
        for this rank's pieces: every rank holds the whole model and adopts
        its own slice, so a write made alike on every rank (a
        ``model.load_state_dict``) reaches every master. Not before the
        start-up broadcast (``pending``), which sets every value. Returns how
        many pieces changed.
        """
        if self.values is None or self.pending is not None:
            return 0
        self.finish_refresh()
        written = {i for i, p in enumerate(self.model_params) if tensor_version(p) != self._versions.get(i)}
        adopted = 0
        with torch.no_grad():
            for piece, master in zip(self.pieces, self.masters, strict=True):
                if piece.param in written:
                    part = self.model_params[piece.param].detach().view(-1)[piece.start : piece.stop]
                    if adopt_written_values(part, master):
                        adopted += 1
        for i in written:
            self._versions[i] = tensor_version(self.model_params[i])
        return adopted

    def _dtype_for(self, index: int) -> torch.dtype:
        if id(self.model_params[index]) in self._keep_fp32 or self.low_dtype is None:
            return torch.float32
        return self.low_dtype

    def _exact_values(self, indices: Sequence[int]) -> dict[int, torch.Tensor]:
        """Exact FP32 values of parameters ``indices``, flattened (collective when gathered)."""
        self.finish_refresh()
        if self.pending is not None:
            return {i: self.pending[i].reshape(-1).float() for i in indices}
        if self.world_size == 1:
            values = self.values
            assert values is not None, "exact values are asked for only in O2, which has FP32 masters"
            return {i: values[slice(*self.layout.param_range(i))] for i in indices}
        out = {i: torch.empty(self.layout.numels[i], dtype=torch.float32, device=self.device) for i in indices}
        self.gather.run(self.masters, out.__getitem__, params=list(indices))
        return out

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        """``{id(param): exact FP32 value}`` for every managed parameter (collective in O2 on several ranks)."""
        self.finish_refresh()
        if self.low_dtype is None:
            return {id(p): p.detach() for p in self.model_params}
        self.adopt_model_writes()
        exact = self._exact_values(range(len(self.model_params)))
        return {id(p): exact[i].view_as(p) for i, p in enumerate(self.model_params)}

    def broadcast(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Make every rank start from rank ``src``'s FP32 values (collective; once, at start-up).

        A no-op once training or a checkpoint load has made the ranks agree.
        """
        if self.pending is None:
            return
        for original in self.pending:  # one tensor at a time: no flat copy of the whole model
            sent = original.detach()  # an alias drop_storage may empty: gloo's Work then holds no start value
            dist.broadcast(sent, src=src, group=group if group is not None else self.group)
            if sent.device.type == "cpu":
                drop_storage([sent])
        with torch.no_grad():
            for piece, master in zip(self.pieces, self.masters, strict=True):
                master.copy_(self.pending[piece.param].reshape(-1)[piece.start : piece.stop])
            for p, original in zip(self.model_params, self.pending, strict=True):
                p.data.copy_(original.view_as(p))
        self.pending = None

    # ------------------------------------------------------------------ gradients
    def zero_master_grads(self) -> None:
        """Clear the FP32 gradient slice (what the next backward sums into)."""
        self.grads.zero()

    # ------------------------------------------------------------------ parameters
    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]:
        """Where this rank's reduced gradients are: its slice's FP32 pieces, by parameter index."""
        return self.grads.reduced_grads()

    def zero_grads(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (freed, or zeroed in place) and this rank's FP32 gradient slice."""
        clear_grads(self.model_params, set_to_none)
        self.zero_master_grads()

    def refresh_model(self, overlap: bool = False) -> None:
        """All-gather every rank's updated slice into the model parameters (collective).

        With ``overlap`` the gather is left running: :meth:`finish_refresh`
        completes it (the parameters a module needs, or all of them).
        """
        self.pending = None
        self.finish_refresh()
        self._refreshing = self.gather.start(self.masters, lambda i: self.model_params[i].data.view(-1))
        if not overlap:
            self.finish_refresh()

    @property
    def gather_running(self) -> bool:
        """Whether a gather :meth:`refresh_model` left running has rounds still to unpack."""
        return self._refreshing is not None

    def finish_refresh(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Complete the all-gather :meth:`refresh_model` left running, for ``params`` or (``None``) all of it.

        Every rank must make the same calls (collectives may launch here).
        Parameters this optimizer does not manage are ignored.
        """
        refreshing = self._refreshing
        if refreshing is None:
            return
        if params is None:
            refreshing.finish()
        else:
            refreshing.finish_params(self._index[id(p)] for p in params if id(p) in self._index)
        if refreshing.done:
            self._refreshing = None

    def state_dict(self) -> list[torch.Tensor]:
        """O2: ``[this rank's FP32 slice]``; O1 and AMP off: ``[]`` (the model holds the values)."""
        self.adopt_model_writes()
        return [] if self.values is None else [self.values.detach()]

    def load_state_dict(self, tensors: Sequence[torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s output and refresh every rank's model (collective in O2).

        Raises:
            ValueError: the saved slice has another length than this rank's.
        """
        if self.values is None:
            return
        if len(tensors) != 1 or tensors[0].numel() != self.values.numel():
            sizes = [t.numel() for t in tensors]
            raise ValueError(
                f"checkpoint holds FP32 master slices of {sizes} elements but this rank's slice has "
                f"{self.values.numel()}; it was saved with another sharding layout: load it with "
                "distamp.checkpoint.load_latest_checkpoint, which re-slices"
            )
        with torch.no_grad():
            self.values.copy_(tensors[0].reshape(-1))
        self.refresh_model()

    def layout_state(self) -> dict:
        """The layout as plain numbers: world size, this rank, parameter sizes and shapes, slice bounds."""
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "numels": list(self.layout.numels),
            "shapes": [list(p.shape) for p in self.model_params],
            "bounds": list(self.layout.bounds),
            "groups": [list(g) for g in self.groups],
        }


def _check_params(params: list[nn.Parameter], low_dtype: torch.dtype | None) -> None:
    allowed = (torch.float32,) if low_dtype is None else (torch.float32, low_dtype)
    names = " or ".join(str(d) for d in allowed)
    for i, p in enumerate(params):
        if p.dtype not in allowed:
            raise TypeError(
                f"strategy.sharding: parameter {i} (shape {tuple(p.shape)}) is {p.dtype}; sharded optimizer "
                f"state needs {names} parameters. Convert the model (model.float()) before building the optimizer"
            )
        if not p.is_contiguous():
            raise ValueError(
                f"strategy.sharding: parameter {i} (shape {tuple(p.shape)}) is not contiguous; slices are "
                "views of the flattened parameter. Make it contiguous (p.data = p.data.contiguous())"
            )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise TypeError(
            f"strategy.sharding needs every parameter of the optimizer on one device; got {sorted(map(str, devices))}"
        )


def _slice_state(state: dict, piece: Piece, numel: int) -> dict:
    """A parameter's optimizer state cut to ``piece``: per-element tensors sliced, the rest (``step``) kept."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and key != "step" and value.numel() == numel:
            value = value.detach().reshape(-1)[piece.start : piece.stop].float().clone()
        out[key] = value
    return out
