"""Views of fp8amp's tensor subclasses that they keep no codes view for.

A ``ScaledTensor`` keeps row views of its codes (they share its one scale); a transpose, a column
slice or any view of a ``BlockScaledTensor`` (whose rows share 128 x 128 blocks) has no codes
view to be. Their values are the base's dequantized. Such a view is a :class:`DequantizedView`
(of a tensor that requires grad, an O1/O2 master, only under ``torch.no_grad()``, where weights
are edited by hand; of an FP8 gradient always): every read
dequantizes the base and takes the view, so it always shows the base's current values, and an
in-place op on it is written into the base, as a plain tensor's view writes into its storage:
``w.t()[0].zero_()`` and ``w[:, 3].mul_(2)`` change ``w``. Elsewhere (a master's view in grad
mode, which autograd may save; compiled code) the view is a plain tensor of the dequantized
values.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from .wrapper_ops import is_view_op, make_wrapper, refuse_collective, written_instances

__all__ = ["DequantizedView", "view_of", "RealValuesMixin"]


def view_of(out, base: torch.Tensor, func, args, kwargs):
    """What a view op ``func(base, *args[1:])`` returns for ``base``, a ScaledTensor or
    BlockScaledTensor, given ``out``, the op on its dequantized values: DequantizedViews (see the
    module docstring for where), else ``out`` itself."""
    if (torch.is_grad_enabled() and base.requires_grad) or torch.compiler.is_compiling():
        return out
    rest = args[1:]

    def view(real: torch.Tensor):
        return func(real, *rest, **kwargs)

    if isinstance(out, torch.Tensor):
        return DequantizedView(out, base, view)
    return type(out)(DequantizedView(o, base, lambda real, i=i: view(real)[i]) for i, o in enumerate(out))


class RealValuesMixin:
    """What torch does with a tensor's storage, done with the real values, for fp8amp's tensors
    that have no storage of their own (ScaledTensor, BlockScaledTensor, DequantizedView: torch's
    own read the absent storage, giving garbage or crashing the process). ``_real_values()``
    gives the values as a plain tensor."""

    def _real_values(self) -> torch.Tensor:
        raise NotImplementedError

    def tolist(self):
        """The real values as (nested) Python numbers, as ``Tensor.tolist`` gives them."""
        return self._real_values().tolist()

    def apply_(self, callable):
        """``callable`` on each real value, written back as any in-place op writes."""
        if self.requires_grad:  # torch's own check and message
            raise RuntimeError("Can't call apply_() on Variable that requires grad. Use var.detach().apply_() instead.")
        real = self._real_values().apply_(callable)
        with torch.no_grad():
            self.copy_(real)
        return self

    def __dlpack__(self, **kwargs):
        """The real values as a DLPack capsule (numpy.from_dlpack, torch.from_dlpack): a copy, as
        ``numpy()`` gives them, with torch's refusal of a tensor that requires grad."""
        if self.requires_grad:
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
        if kwargs.get("copy") is False:
            raise BufferError(f"fp8amp.{type(self).__name__}: its values are computed from its codes and scales, so "
                              "a DLPack export is a copy; pass copy=None or copy=True")
        return self._real_values().__dlpack__(**kwargs)

    def share_memory_(self):
        """Refused: torch shares a tensor's storage between processes, and there is none."""
        raise RuntimeError(
            f"fp8amp.{type(self).__name__}: share_memory_() is not supported (an O1/O2 master, an FP8 gradient or a "
            "view of one is a wrapper of codes and scales, with no storage of its own to share); share a copy (a "
            "view's .clone().share_memory_()), train with several processes through torch.distributed (DDP, FSDP2: "
            "docs/distributed.md), or share a model converted for FP8 compute only (fp8amp.convert), whose "
            "weights are plain tensors")

    def __format__(self, format_spec: str) -> str:
        # torch formats the value of a 0-d tensor only when its type is exactly Tensor, so
        # f"{w[0, 0]:.4f}" of a master or an FP8 gradient raised "unsupported format string".
        if self.dim() == 0 and not self.is_meta:
            return self._real_values().detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)


class DequantizedView(RealValuesMixin, torch.Tensor):
    """A view ``view_fn(base)`` of a ScaledTensor or BlockScaledTensor ``base`` (see the module
    docstring): a tensor of the view's shape, strides and logical dtype with no storage of its
    own."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, base: torch.Tensor, view_fn):
        self = make_wrapper(cls, like, base, strides=like.stride(), storage_offset=like.storage_offset(),
                            dtype=like.dtype, device=like.device)
        self._viewed, self._view_fn = base, view_fn
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The view's current values, a plain tensor (of the base's logical dtype by default)."""
        return self._view_fn(self._viewed.dequantize(dtype))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refuse_collective(func, cls.__name__)
        written = written_instances(func, args, kwargs, DequantizedView)
        # Each written view is taken of its base's values in float32 (one copy a base, which
        # several views may share), so the op writes into them; each base then re-quantizes
        # them. A view read only is taken at the logical dtype.
        bases = {}
        for v in written:
            if id(v._viewed) not in bases:
                bases[id(v._viewed)] = (v._viewed, v._viewed.dequantize(torch.float32))
        targets = {id(v): v._view_fn(bases[id(v._viewed)][1]) for v in written}
        plain_args, plain_kwargs = tree_map_only(
            DequantizedView, lambda t: targets[id(t)] if id(t) in targets else t.values(), (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if written:
            with torch.no_grad():
                for base, real in bases.values():
                    base.copy_(real)
            back = {id(targets[id(v)]): v for v in written}
            return tree_map_only(torch.Tensor, lambda t: back.get(id(t), t), out)
        if is_view_op(func) and args and isinstance(args[0], DequantizedView):
            first = args[0]
            return view_of(out, first._viewed, lambda real, *rest, **kw: func(first._view_fn(real), *rest, **kw),
                           args, kwargs)
        return out

    def _real_values(self) -> torch.Tensor:
        return self.values()

    def numpy(self, *, force: bool = False):
        return self.values().numpy(force=force)

    def __array__(self, dtype=None):
        return self.values().__array__(dtype)

    def __reduce_ex__(self, protocol):
        return self.values().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.values().clone()

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"DequantizedView({self.values()!r})"
