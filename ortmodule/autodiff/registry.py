"""The gradient-rule registry and the builder that rules emit their nodes through.

A rule is one function registered for an ONNX ``(domain, op_type)``::

    @register("Relu")
    def relu_grad(g: GradBuilder, node: ir.Node, dys: Sequence[ir.Value | None]):
        (y,) = node.outputs
        return [g.op("Where", [g.op("Greater", [y, g.zeros_like_scalar(y)]), dys[0], g.zeros_like_scalar(y)])]

The contract (STYLE.md §2): a rule gets the forward node, the builder, and one output gradient per
node output (``None`` where no gradient flows to that output; at least one is not ``None``). It
returns one entry per node input, ``None`` meaning "no gradient". Each returned gradient must have the
shape of its input: :meth:`GradBuilder.reduce_to` undoes broadcasting in one shared place. Nodes that
no trainable value needs are pruned afterwards, so a rule may build every input gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

# NOTE [kinks as torch] (export/semantics.py): which torch function's backward a node's rule follows.
GRAD_KIND_KEY = "pkg.ortmodule.grad_kind"

Rule = Callable[["GradBuilder", ir.Node, Sequence["ir.Value | None"]], Sequence["ir.Value | None"]]


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    domain: str
    op_type: str
    fn: Rule | None  # None: the op is not differentiable (its outputs never carry gradient)
    zero_derivative: bool = False  # differentiable with derivative zero (NOTE [zero derivatives])


_RULES: dict[tuple[str, str], RuleInfo] = {}


def register(op_type: str, domain: str = "") -> Callable[[Rule], Rule]:
    """Register ``fn`` as the gradient rule of ``(domain, op_type)``."""

    def deco(fn: Rule) -> Rule:
        key = (domain, op_type)
        if key in _RULES:
            raise ValueError(f"a gradient rule for {domain or 'ai.onnx'}::{op_type} is already registered")
        _RULES[key] = RuleInfo(domain, op_type, fn)
        return fn

    return deco


def register_nondifferentiable(*op_types: str, domain: str = "") -> None:
    """Mark ops whose outputs carry no gradient (shape ops, comparisons, index ops)."""
    for op_type in op_types:
        key = (domain, op_type)
        if key in _RULES:
            raise ValueError(f"a gradient rule for {domain or 'ai.onnx'}::{op_type} is already registered")
        _RULES[key] = RuleInfo(domain, op_type, None)


def register_zero_derivative(*op_types: str, domain: str = "") -> None:
    """Mark ops whose derivative is zero (Round, Floor, ...): their outputs stay on the gradient path, as in
    torch, and pass a zero gradient to their inputs (NOTE [zero derivatives] in rules/shape.py)."""
    for op_type in op_types:
        key = (domain, op_type)
        if key in _RULES:
            raise ValueError(f"a gradient rule for {domain or 'ai.onnx'}::{op_type} is already registered")
        _RULES[key] = RuleInfo(domain, op_type, _no_contribution, zero_derivative=True)


def _no_contribution(g: GradBuilder, node: ir.Node, dys) -> list[None]:
    return [None] * len(node.inputs)


# A rule's precondition: ``check(node)`` says why the rule cannot differentiate this node (an attribute
# value it does not cover), or None. The rule raises with the same words; OnnxModule asks at load time,
# so a file is refused when it is opened, not at its first backward.
_CHECKS: dict[tuple[str, str], Callable[[ir.Node], str | None]] = {}


def register_check(op_type: str, domain: str = "") -> Callable:
    """Register the precondition ``fn(node) -> reason | None`` of ``(domain, op_type)``'s rule."""

    def deco(fn):
        _CHECKS[(domain, op_type)] = fn
        return fn

    return deco


def refusal(domain: str, op_type: str, node: ir.Node) -> str | None:
    """Why the registered rule cannot differentiate ``node``, or None."""
    check = _CHECKS.get(("" if domain == "ai.onnx" else domain, op_type))
    return None if check is None else check(node)


def lookup(domain: str, op_type: str) -> RuleInfo | None:
    return _RULES.get(("" if domain == "ai.onnx" else domain, op_type))


def registered_ops() -> list[tuple[str, str]]:
    """Every registered ``(domain, op_type)``, differentiable or not."""
    return sorted(_RULES)


def is_float(dtype: ir.DataType | None) -> bool:
    return dtype is not None and dtype.is_floating_point()


class GradBuilder:
    """Emits backward nodes for the rules; shared helpers live here, not in each rule."""

    def __init__(self, opset: int, dim_values: dict[str, int] | None = None) -> None:
        self.opset = opset
        # NOTE [reference dims]: the size each symbolic dim had at export time (see partition.py)
        self.dim_values = dim_values or {}
        self.nodes: list[ir.Node] = []
        self._node: ir.Node | None = None  # the forward node whose rule is running
        self.active: set[ir.Value] = set()  # the values on a gradient path (set by build_gradient)
        self._count = 0

    # -- node emission -------------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: dict | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
        dtype: ir.DataType | None = None,
        shape: ir.Shape | None = None,
    ) -> ir.Value:
        outs = self.op_multi(op_type, inputs, attributes, domain=domain, num_outputs=num_outputs)
        if dtype is not None:
            outs[0].dtype = dtype
        if shape is not None:
            outs[0].shape = shape
        return outs[0]

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: dict | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
    ) -> Sequence[ir.Value]:
        attrs = [ir.convenience.convert_attribute(k, v) for k, v in (attributes or {}).items()]
        self._count += 1
        base = self._node.name if self._node is not None and self._node.name else "grad"
        node = ir.Node(
            domain,
            op_type,
            inputs,
            attrs,
            num_outputs=num_outputs,
            name=f"{base}_Grad/{op_type}_{self._count}",
        )
        if self._node is not None:
            # Keep the exporter's provenance (module path) on the backward nodes too.
            for k, v in self._node.metadata_props.items():
                node.metadata_props[k] = v
        self.nodes.append(node)
        return node.outputs

    def aten(self, op: str, inputs: Sequence[ir.Value | None], args: Sequence, outputs: Sequence[int]
             ) -> Sequence[ir.Value]:
        """An ``ATen`` node calling torch's ``op`` (NOTE [ATen kernels]): ``args`` is its argument
        list with ``Arg(i)`` for the node's input i; the node's outputs are the returned tensors at
        ``outputs``."""
        from ..runtime.torch_nodes import ATEN_OP, TORCH_DOMAIN, encode_args

        return self.op_multi(ATEN_OP, inputs, {"op": op, "args": encode_args(args), "outputs": list(outputs)},
                             domain=TORCH_DOMAIN, num_outputs=len(outputs))

    # -- constants -----------------------------------------------------------------------------
    def const(self, value, dtype: ir.DataType | None = None) -> ir.Value:
        """A Constant node; ``dtype`` defaults to float32 for floats and int64 for ints."""
        arr = np.asarray(value)
        if dtype is not None:
            arr = arr.astype(dtype.numpy())
        elif arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype.kind == "i":
            arr = arr.astype(np.int64)
        out = self.op("Constant", [], {"value": ir.tensor(arr)})
        out.dtype = ir.DataType.from_numpy(arr.dtype)
        out.shape = ir.Shape(arr.shape)
        return out

    def scalar_like(self, value: float, like: ir.Value) -> ir.Value:
        """A 0-d constant of ``like``'s dtype."""
        return self.const(value, like.dtype or ir.DataType.FLOAT)

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64))

    # -- shape helpers -------------------------------------------------------------------------
    def shape_of(self, x: ir.Value) -> ir.Value:
        """``Shape(x)``, or a constant where the shape is static."""
        static = static_shape(x)
        if static is not None:
            return self.ints(static)
        return self.op("Shape", [x], dtype=ir.DataType.INT64)

    def reshape_like(self, g: ir.Value, x: ir.Value) -> ir.Value:
        return self.op("Reshape", [g, self.shape_of(x)], dtype=x.dtype, shape=x.shape)

    def expand_like(self, g: ir.Value, x: ir.Value) -> ir.Value:
        return self.op("Expand", [g, self.shape_of(x)], dtype=x.dtype, shape=x.shape)

    def cast_like(self, g: ir.Value, x: ir.Value) -> ir.Value:
        return self.op("Cast", [g], {"to": int(x.dtype)}, dtype=x.dtype)

    def reduce_sum(self, g: ir.Value, axes: Sequence[int], keepdims: bool) -> ir.Value:
        return self.op("ReduceSum", [g, self.ints(axes)], {"keepdims": int(keepdims)}, dtype=g.dtype)

    def reduce_to(self, g: ir.Value, x: ir.Value, g_shape: ir.Shape | None) -> ir.Value:
        """Sum ``g`` (of the broadcast shape ``g_shape``) down to the shape of ``x``.

        # NOTE [unbroadcast]: where both shapes are known the reduced axes are fixed at build time
        # (leading extra axes, then axes where x has a static 1 and g does not). Where a dim is
        # symbolic, the axes are found at run time by comparing Shape(g) with Shape(x) left-padded
        # with ones; ReduceSum with ``noop_with_empty_axes=1`` makes "nothing to reduce" a no-op.
        """
        x_shape = x.shape
        if g_shape is not None and x_shape is not None:
            rg, rx = len(g_shape), len(x_shape)
            lead = list(range(rg - rx))
            decidable = True
            inner: list[int] = []
            for i in range(rx):
                dx, dg = x_shape[i], g_shape[rg - rx + i]
                if dx == dg or (isinstance(dx, int) and dx != 1):
                    continue  # equal, or x has a real extent there: broadcasting cannot have expanded x
                if dx == 1:
                    inner.append(i)  # summing a size-1 g axis too is a no-op
                    continue
                vx, vg = self._reference_dim(dx), self._reference_dim(dg)
                if vx is not None and vg is not None and vx == vg:
                    continue  # equal at the reference shapes: NOTE [reference dims]
                if vx == 1 and vg is not None:
                    inner.append(i)
                    continue
                decidable = False
            if decidable:
                out = g
                if lead:
                    out = self.reduce_sum(out, lead, keepdims=False)
                if inner:
                    out = self.reduce_sum(out, inner, keepdims=True)
                out.shape = x_shape
                out.dtype = x.dtype
                return out
        # Dynamic: compare shapes at run time.
        shape_g = self.op("Shape", [g], dtype=ir.DataType.INT64)
        rank_g = g_shape.rank() if g_shape is not None else None
        rank_x = x_shape.rank() if x_shape is not None else None
        if rank_g is None or rank_x is None:
            raise ValueError(
                f"cannot reduce a gradient to the shape of {x.name!r}: its rank is unknown "
                "(run shape inference on the forward graph)"
            )
        out = g
        if rank_g > rank_x:
            out = self.reduce_sum(out, list(range(rank_g - rank_x)), keepdims=False)
            shape_g = self.op("Shape", [out], dtype=ir.DataType.INT64)
        shape_x = self.op("Shape", [x], dtype=ir.DataType.INT64)
        differs = self.op("Not", [self.op("Equal", [shape_g, shape_x])])
        axes = self.op("Reshape", [self.op("NonZero", [differs]), self.ints([-1])])
        out = self.op(
            "ReduceSum", [out, axes], {"keepdims": 1, "noop_with_empty_axes": 1}, dtype=x.dtype, shape=x_shape
        )
        return out

    def _reference_dim(self, d) -> int | None:
        if isinstance(d, int):
            return d
        value = getattr(d, "value", None)
        return self.dim_values.get(value) if value is not None else None

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.op("Add", [a, b], dtype=a.dtype, shape=_broadcast_shape(a, b))

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.op("Mul", [a, b], dtype=a.dtype)

    def neg(self, a: ir.Value) -> ir.Value:
        return self.op("Neg", [a], dtype=a.dtype, shape=a.shape)


def _broadcast_shape(a: ir.Value, b: ir.Value) -> ir.Shape | None:
    """The shape of ``a op b`` where it is obvious (equal shapes, or one side 0-d); else unknown.

    Annotating ``a.shape`` unconditionally was wrong for ``scalar + tensor`` (ORT warns and falls back).
    """
    if a.shape is None or b.shape is None:
        return None
    if a.shape == b.shape or b.shape.rank() == 0:
        return a.shape
    if a.shape.rank() == 0:
        return b.shape
    return None


def static_shape(x: ir.Value) -> list[int] | None:
    shape = x.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return [int(d) for d in shape]


def attr(node: ir.Node, name: str, default=None):
    """An attribute's Python value, or ``default``."""
    a = node.attributes.get(name)
    return default if a is None else a.value


def text(v) -> str:
    """A string attribute value (onnx_ir gives bytes or str) as str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def attr_str(node: ir.Node, name: str, default: str) -> str:
    """A string attribute's value as str, or ``default``."""
    return text(attr(node, name, default))


def input_or_none(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None
