"""VGG-11/13/16/19 (torchvision configurations A, B, D, E) training step, described as a Tape.

The model only *describes* one SGD step (tensors, and ops that read and write them by name);
a memory policy in proto.vm decides where the tensors live while the ops run.

Architecture choices (each keeps the tape exact and the math torchvision's):
- Widths: every channel count and the 4096-wide classifier are scaled by `width` (at least 1);
  `hidden` overrides the classifier width (simulator tests keep it small: its GEMMs would
  cost more there than all the convolutions).
- No adaptive average pool: the classifier reads the last pooling output flattened, so its
  input has C * (S/32)^2 features for an S x S image. At 224 the last map is 7x7 and
  torchvision's AdaptiveAvgPool2d((7, 7)) is the identity, so this *is* torchvision there.
- No dropout (torchvision's classifier.2 and .5): the step stays deterministic, so it can be
  checked against a reference; a dropout mask would be one more saved tensor per layer.
- ReLU is fused into the producing conv/linear's epilogue, so no pre-activation tensor exists
  (as memory-lean as torchvision's ReLU(inplace=True)) and every forward tensor has exactly
  one writer in the forward, which recomputation relies on.
- ReLU backward is fused into the backward of the layer that reads the ReLU's output y, where
  that layer is a convolution (backward-data) or a pooling: that op writes y's gradient,
  already masked by y > 0, over y itself (the kernels' `relu_mask`). So the gradient of a
  conv's output *is* the tensor "<layer>.out", rewritten in backward, and the step never holds
  y, its gradient and the next one at once: at 224x224 a conv's backward-data holds two
  activations, not three (torch's threshold_backward makes a new tensor), and the separate
  pass over y and dy is gone. The classifier's ReLUs (read by linear layers) keep an op of
  their own, "<layer>.relu_bwd", that masks dy in place.
- `front_splits` S > 1 runs the first block (the convolutions before the first pool, and that
  pool) in S micro-batches of batch/S images, forward and backward, each with tensors of its
  own: at 224x224 and batch 256 conv1's two outputs are 6.6 GB made in the step's first 36 ms
  and needed again only in its last 80, and in pieces a memory policy can send the first
  micro-batch's to the host while the next one computes, and bring them back one piece at a
  time. The pool's pieces are joined (device copies) into the whole-batch tensor conv2
  reads; the block's parameter gradients are one tensor per micro-batch, summed in order.
  Every policy runs the same tape, so their results stay comparable bit for bit; against an
  unsplit step only the summation order of those gradients changes.

Convolutions (`convolution`): "direct" runs kernels.conv's implicit GEMMs everywhere;
"winograd" runs kernels.winograd's for every 3x3 layer but the first (whose 3 input channels
leave little to save) whose input and output both have at least `winograd_min_channels`
channels (128 by default: on the H200, Winograd F(2x2, 3x3) took 0.60-0.95 of the direct
time at 256 and 512 channels, tied or lost at 128 and took 1.7-1.8x at 64; F(4x4, 3x3), which
replaced it, took 0.53-0.66 of F(2x2)'s time at 256-512 channels, so it should win at 128
and tie or lose at 64, where half its GEMM tiles are padding: kernel_speed times each
stage), each op with a workspace of its own [workspace] ("<layer>.fwd_winograd",
"<layer>.bwd_data_winograd", "<layer>.bwd_weight_winograd"), sized for as many images a chunk
as keep it within the layer's input activation.

Tensor names (kinds as proto.tape): "images" (B,3,S,S) and "labels" (B,) int32 [input];
torchvision parameter names "features.{i}.weight", "classifier.{j}.bias", ... [param];
"<param>.grad" [grad]; "<param>.momentum" [state]; "<layer>.out" for each conv (after its
ReLU), pool and linear layer, named by the layer's torchvision index [activation; a conv's
is written again in backward, as its own gradient]; "<tensor>.grad" in backward for the other
tensors [activation; a linear ReLU layer's is written twice: by its producer, then masked in
place by the ReLU backward]; "loss" (1,) [activation, written last: a result of the step].
The last linear's output "classifier.6.out" is the logits.

Ops, in order: "<layer>.fwd" per layer; "loss"; per layer in reverse "<layer>.relu_bwd" (linear
layers with a ReLU), "<layer>.bwd_weight" (before bwd_data, which writes over the saved
input), "<layer>.bwd_data" (not for the first conv: the images need no gradient), or
"<layer>.bwd" for pools; then "<param>.sgd" per parameter (PyTorch SGD: momentum, weight
decay). With front_splits S > 1 the first block's ops are "<layer>.mb<k>.fwd" (and so on) per
micro-batch k, on "<layer>.out.mb<k>" and "<param>.grad.mb<k>"; "<pool>.join" follows its
forward, and "<param>.grad_sum" its backward.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import numpy as np

from kernels import _check, conv, elementwise, linear, loss as xent, pool, relu, sgd, winograd
from proto import graph
from proto.models import checked_params
from proto.tape import Op, Tape, TensorSpec

# torchvision.models.vgg.cfgs: output channels of each 3x3 conv, "M" = 2x2 max-pool.
CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}
HIDDEN = 4096
CONVOLUTIONS = ("direct", "winograd")


@dataclasses.dataclass(frozen=True)
class VGGConfig:
    depth: int = 16
    width: float = 1.0          # channel multiplier (1/8 -> 8..64 channels, 512 hidden)
    image_size: int = 224       # square images; a multiple of 32 (five 2x2 pools)
    batch: int = 32
    num_classes: int = 1000
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    hidden: int | None = None   # classifier width; default 4096 * width
    convolution: str = "direct"  # or "winograd" (the module docstring says where)
    winograd_min_channels: int = 128  # "winograd": only layers this wide in and out
    front_splits: int = 1       # micro-batches the first block runs in (a divisor of batch)

    def __post_init__(self):
        # NumPy scalars are accepted and stored as Python numbers; bools and strings are not.
        def keep(name, value):
            object.__setattr__(self, name, value)

        if not _check._is_integer(self.depth) or self.depth not in CONFIGS:
            raise ValueError(f"depth: expected one of {sorted(CONFIGS)}, got {self.depth!r}")
        keep("depth", int(self.depth))
        keep("width", _check.number("width", self.width, positive=True))
        keep("image_size", _check.positive("image_size", self.image_size))
        if self.image_size < 32 or self.image_size % 32:
            raise ValueError(f"image_size: expected a multiple of 32 (five 2x2 pools), got {self.image_size!r}")
        if self.hidden is not None:
            keep("hidden", _check.positive("hidden", self.hidden))
        for name in ("batch", "num_classes"):
            keep(name, _check.positive(name, getattr(self, name)))
        for name in ("lr", "momentum", "weight_decay"):
            keep(name, _check.number(name, getattr(self, name), at_least=0))
        if self.convolution not in CONVOLUTIONS:
            raise ValueError(f"convolution: expected one of {CONVOLUTIONS}, got {self.convolution!r}")
        keep("winograd_min_channels", _check.positive("winograd_min_channels",
                                                      self.winograd_min_channels))
        keep("front_splits", _check.positive("front_splits", self.front_splits))
        if self.batch % self.front_splits:
            raise ValueError(f"front_splits: expected a divisor of batch={self.batch}, got "
                             f"{self.front_splits}")

    def channels(self, c: int) -> int:
        return max(1, int(round(c * self.width)))


@dataclasses.dataclass(frozen=True)
class Layer:
    kind: Literal["conv", "pool", "linear"]
    name: str            # torchvision module name: "features.0", "classifier.3"
    cin: int             # input channels (conv, pool) or features (linear)
    cout: int
    size: int            # input height = width (conv, pool); 0 for linear
    relu: bool           # ReLU fused into the forward epilogue
    input: str           # tensor names
    output: str

    @property
    def params(self) -> tuple[str, ...]:
        return () if self.kind == "pool" else (f"{self.name}.weight", f"{self.name}.bias")


def layers(cfg: VGGConfig) -> list[Layer]:
    out, index, c, size, x = [], 0, 3, cfg.image_size, "images"
    for v in CONFIGS[cfg.depth]:
        name = f"features.{index}"
        if v == "M":
            out.append(Layer("pool", name, c, c, size, False, x, f"{name}.out"))
            size //= 2
            index += 1
        else:
            k = cfg.channels(v)
            out.append(Layer("conv", name, c, k, size, True, x, f"{name}.out"))
            c = k
            index += 2   # the conv and its ReLU module
        x = out[-1].output
    hidden = cfg.channels(HIDDEN) if cfg.hidden is None else cfg.hidden
    dims = [c * size * size, hidden, hidden, cfg.num_classes]
    for j, (i, o) in enumerate(zip(dims, dims[1:])):
        name = f"classifier.{3 * j}"
        out.append(Layer("linear", name, i, o, 0, j < 2, x, f"{name}.out"))
        x = out[-1].output
    return out


def param_shapes(cfg: VGGConfig) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for L in layers(cfg):
        if L.kind == "conv":
            shapes[f"{L.name}.weight"] = (L.cout, L.cin, 3, 3)
        elif L.kind == "linear":
            shapes[f"{L.name}.weight"] = (L.cout, L.cin)
        if L.kind != "pool":
            shapes[f"{L.name}.bias"] = (L.cout,)
    return shapes


def random_state_dict(cfg: VGGConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights as PyTorch initializes them: conv weights Kaiming-normal (fan_out, ReLU) as
    torchvision's VGG; everything else PyTorch's layer default, U(-1/sqrt(fan_in), ..), which
    (unlike torchvision's zero biases and N(0, 0.01) classifier) leaves every bias and the
    logits non-trivial, so a dropped term shows in a test."""
    rng = np.random.default_rng(seed)
    shapes, state = param_shapes(cfg), {}
    for L in layers(cfg):
        if L.kind == "pool":
            continue
        w, b = L.params
        bound = 1.0 / np.sqrt(np.prod(shapes[w][1:]))               # 1 / sqrt(fan_in)
        if L.kind == "conv":
            std = np.sqrt(2.0 / (L.cout * 9))                        # Kaiming, fan_out, ReLU
            state[w] = (rng.standard_normal(shapes[w]) * std).astype(np.float32)
        else:
            state[w] = rng.uniform(-bound, bound, shapes[w]).astype(np.float32)
        state[b] = rng.uniform(-bound, bound, shapes[b]).astype(np.float32)
    return state


def load_state_dict(cfg: VGGConfig, state_dict, *, allow_nonfinite: bool = False
                    ) -> dict[str, np.ndarray]:
    """float32 copies of a torchvision-named state dict (NumPy arrays or CPU tensors); a
    missing, unexpected, misshaped, non-numeric or (unless `allow_nonfinite`) non-finite
    entry raises ValueError naming it (proto.models.checked_params). A torchvision VGG of
    the same depth loads at width 1, image_size 224."""
    return checked_params(param_shapes(cfg), state_dict, what=f"VGG-{cfg.depth}",
                          allow_nonfinite=allow_nonfinite)


# ---------------------------------------------------------------------------- the tape
class _Part(NamedTuple):
    """Rows lo:hi of tensor `name`: a micro-batch's share of a whole-batch tensor."""
    name: str
    lo: int
    hi: int


def _name(ref) -> str:
    return ref.name if isinstance(ref, _Part) else ref


def _get(a, ref):
    """The device array an op body works on: a tensor, or a micro-batch's rows of one."""
    return a[ref.name][ref.lo:ref.hi] if isinstance(ref, _Part) else a[ref]


def build_tape(cfg: VGGConfig, *, host_math: bool = False) -> Tape:
    """The step's tensors and ops. host_math: each op computes with its kernels' NumPy
    references on host copies of its tensors instead of launching the kernels (the same
    tensors, reads and writes; every result stored as the tensor's dtype): on the simulator a
    step then takes seconds, not minutes. Host math cannot be recorded into a graph."""
    B, S = cfg.batch, cfg.front_splits
    tensors: dict[str, TensorSpec] = {}
    ops: list[Op] = []

    def tensor(name, shape, kind, dtype=np.float32):
        tensors[name] = TensorSpec(name, tuple(shape), kind, np.dtype(dtype))
        return name

    def op(name, phase, reads, writes, bodies, flops, layer):
        """reads, writes: tensor names, or a micro-batch's rows of one (_Part). bodies:
        (device body, NumPy function of the reads' values -> the writes' values)."""
        run = _on_host(bodies[1], reads, writes) if host_math else bodies[0]
        ops.append(Op(name, phase, tuple(map(_name, reads)), tuple(map(_name, writes)), run,
                      float(flops), layer))

    tensor("images", (B, 3, cfg.image_size, cfg.image_size), "input")
    tensor("labels", (B,), "input", np.int32)
    for name, shape in param_shapes(cfg).items():
        tensor(name, shape, "param")
        tensor(f"{name}.grad", shape, "grad")
        tensor(f"{name}.momentum", shape, "state")
    net = layers(cfg)
    # The front (the layers up to the first pool, and that pool) runs in S micro-batches
    # (module doc): its outputs are one tensor per micro-batch; the pool's pieces are then
    # joined into the whole-batch tensor the next layer reads.
    front = net[:[L.kind for L in net].index("pool") + 1] if S > 1 else []
    split = {L.output for L in front}
    n = B // S
    shape_of = {"images": tensors["images"].shape}
    for L in net:
        if L.kind == "linear":
            shape_of[L.output] = (B, L.cout)
        else:
            side = L.size if L.kind == "conv" else L.size // 2
            shape_of[L.output] = (B, L.cout, side, side)
        for k in range(S) if L.output in split else ():
            tensor(f"{L.output}.mb{k}", (n,) + shape_of[L.output][1:], "activation")
        if L.output not in split or L.kind == "pool":
            tensor(L.output, shape_of[L.output], "activation")

    def ref(t: str, k: int | None):
        """Tensor t as micro-batch k sees it: its own tensor, or its rows of a whole one."""
        if k is None:
            return t
        return f"{t}.mb{k}" if t in split else _Part(t, k * n, (k + 1) * n)

    def shape(t: str, k: int | None) -> tuple:
        return shape_of[t] if k is None else (n,) + shape_of[t][1:]

    def winograd_at(L) -> bool:
        return (cfg.convolution == "winograd" and L.input != "images"
                and min(L.cin, L.cout) >= cfg.winograd_min_channels)

    def winograd_workspace(L, kind, x_shape) -> str:
        """A Winograd op's workspace tensor: as many images a chunk as keep it within the
        layer's input activation, at least one (a front layer's micro-batches share it)."""
        w_shape = tensors[L.params[0]].shape
        images = winograd.chunk_images(x_shape, w_shape, pad=1, floats=int(np.prod(x_shape)))
        size = winograd.workspace_size(x_shape, w_shape, pad=1, images=images)
        return tensor(f"{L.name}.{kind}_winograd", (size,), "workspace")

    # forward: the front micro-batch by micro-batch, then the rest
    def forward(L, k):
        x, y, tag, share = ref(L.input, k), ref(L.output, k), _tag(L, k), 1 if k is None else S
        if L.kind == "conv":
            flops = conv.conv2d_flops(B, L.cin, L.cout, 3, 3, L.size, L.size) / share
            ws = (winograd_workspace(L, "fwd", shape(L.input, k)),) if winograd_at(L) else ()
            op(f"{tag}.fwd", "forward", (x, *L.params), (y, *ws), _conv_fwd(L, x, y, *ws),
               flops, L.name)
        elif L.kind == "pool":
            op(f"{tag}.fwd", "forward", (x,), (y,), _pool_fwd(x, y),
               pool.maxpool_flops(int(np.prod(shape(L.input, k)))), L.name)
        else:
            op(f"{tag}.fwd", "forward", (x, *L.params), (y,), _linear_fwd(L),
               linear.linear_flops(B, L.cin, L.cout), L.name)

    for k in range(S) if front else ():
        for L in front:
            forward(L, k)
    if front:
        P = front[-1]
        parts = [f"{P.output}.mb{k}" for k in range(S)]
        op(f"{P.name}.join", "forward", parts, (P.output,), _join(parts, P.output, n),
           int(np.prod(shape_of[P.output])), P.name)
    for L in net[len(front):]:
        forward(L, None)

    # loss
    logits = net[-1].output
    tensor("loss", (1,), "activation")
    tensor(f"{logits}.grad", shape_of[logits], "activation")
    op("loss", "loss", (logits, "labels"), ("loss", f"{logits}.grad"), _loss(logits),
       xent.softmax_xent_flops(B, cfg.num_classes), net[-1].name)

    # backward. A ReLU output read by a conv or a pool is its own gradient (module doc).
    producer = {L.output: L for L in net}
    masked = {L.input for L in net if L.kind != "linear" and L.input in producer
              and producer[L.input].relu}

    def grad(t: str) -> str:
        return t if t in masked else f"{t}.grad"

    def backward(L, k):
        x, dy, dx = ref(L.input, k), ref(grad(L.output), k), ref(grad(L.input), k)
        tag, share = _tag(L, k), 1 if k is None else S
        needs_dx = L.input != "images"
        mask = grad(L.input) == L.input      # this op's dx goes over its input, masked by it
        if needs_dx and not mask:
            tensor(grad(L.input), shape_of[L.input], "activation")
        if L.kind == "pool":
            op(f"{tag}.bwd", "backward", (x, dy), (dx,), _pool_bwd(x, dy, dx, mask),
               pool.maxpool_flops(int(np.prod(shape(L.input, k)))), L.name)
            return
        if L.relu and grad(L.output) != L.output:   # in place: dy becomes the pre-activation's gradient
            op(f"{tag}.relu_bwd", "backward", (L.output, dy), (dy,), _relu_bwd(L.output, dy, dy),
               relu.relu_flops(int(np.prod(shape_of[L.output]))), L.name)
        w, b = L.params
        grads = ((f"{w}.grad", f"{b}.grad") if k is None else
                 (tensor(f"{w}.grad.mb{k}", tensors[w].shape, "activation"),
                  tensor(f"{b}.grad.mb{k}", tensors[b].shape, "activation")))
        dx_writes = (dx,)
        if L.kind == "conv":
            flops = conv.conv2d_flops(B, L.cin, L.cout, 3, 3, L.size, L.size) / share
            # The weight gradient's workspace, a tensor of the tape so the memory policies
            # count it: Winograd's transforms, or where the direct kernel's split reduction
            # keeps its partial sums (none when the reduction is not split).
            x_shape = shape(L.input, k)
            size = conv.wgrad_workspace_size(x_shape, tensors[w].shape, pad=1)
            algorithm, ws = conv, None
            if winograd_at(L):
                algorithm, ws = winograd, winograd_workspace(L, "bwd_weight", x_shape)
                dx_writes += (winograd_workspace(L, "bwd_data", x_shape),)
            elif size:
                ws = tensor(f"{L.name}.wgrad_partials", (size,), "workspace")
            wgrad = _conv_bwd_weight(x, dy, *grads, ws, algorithm, tensors[w].shape)
            grads += (ws,) if ws else ()
            dgrad = _conv_bwd_data(L, dy, dx, mask, x_shape, *dx_writes[1:])
        else:
            flops = linear.linear_flops(B, L.cin, L.cout)
            wgrad = _linear_bwd_weight(L, dy)
            dgrad = _linear_bwd_data(L, dy, dx, shape_of[L.input])
        op(f"{tag}.bwd_weight", "backward", (x, dy), grads, wgrad, flops, L.name)
        if needs_dx:
            op(f"{tag}.bwd_data", "backward", (w, dy) + ((x,) if mask else ()),
               dx_writes, dgrad, flops, L.name)

    for L in reversed(net[len(front):]):
        backward(L, None)
    for k in reversed(range(S)) if front else ():
        for L in reversed(front):
            backward(L, k)
    for L in front:   # the micro-batches' parameter gradients, summed in micro-batch order
        for p in L.params:
            pieces = [f"{p}.grad.mb{k}" for k in range(S)]
            op(f"{p}.grad_sum", "backward", pieces, (f"{p}.grad",), _grad_sum(pieces, f"{p}.grad"),
               (S - 1) * int(np.prod(tensors[p].shape)), L.name)

    # update
    for L in net:
        for p in L.params:
            op(f"{p}.sgd", "update", (p, f"{p}.grad", f"{p}.momentum"), (p, f"{p}.momentum"),
               _sgd(p, cfg), sgd.sgd_flops(int(np.prod(tensors[p].shape))), L.name)
    return Tape(tensors, ops)


def _tag(L: Layer, k: int | None) -> str:
    """An op's name prefix: the layer's, and its micro-batch's ("features.0.mb1")."""
    return L.name if k is None else f"{L.name}.mb{k}"


# Op bodies: each returns (device body, host body). The device body launches kernels on
# `a[name]` (device arrays) and nothing else; the host body computes the same op's outputs from
# its inputs' values with the kernels' NumPy references (build_tape(host_math=True)).
def _on_host(ref, reads, writes):
    """A device body that runs `ref` on host copies of the reads and stores what it returns
    into the writes (in order; a workspace the reference does not need is left alone)."""
    def run(a, stream):
        graph.require_eager("an op computed with host math")
        outs = ref(*[_get(a, r).copy_to_host() for r in reads])
        for w, v in zip(writes, outs):
            dst = _get(a, w)
            dst.copy_to_device(np.ascontiguousarray(v, dtype=dst.dtype))
    return run


def _conv_fwd(L, x, y, workspace=None):
    """kernels.conv's, or kernels.winograd's with its `workspace` (a tensor's name)."""
    w, b = L.params

    def run(a, stream):
        if workspace:
            winograd.conv2d(_get(a, x), a[w], a[b], _get(a, y), pad=1, relu=True,
                            workspace=a[workspace], stream=stream)
        else:
            conv.conv2d(_get(a, x), a[w], a[b], _get(a, y), pad=1, relu=True, stream=stream)
    return run, lambda x, w, b: [conv.conv2d_ref(x, w, b, pad=1, relu=True)]


def _conv_bwd_weight(x, dy, dw, db, workspace, algorithm, w_shape):
    """`algorithm`: kernels.conv (its split partials in `workspace`, if any) or
    kernels.winograd (its transforms in `workspace`): the same call."""
    def run(a, stream):
        algorithm.conv2d_bwd_weight(_get(a, x), _get(a, dy), a[dw], a[db], pad=1,
                                    workspace=a[workspace] if workspace else None, stream=stream)
    return run, lambda x, dy: conv.conv2d_bwd_weight_ref(x, dy, w_shape, pad=1)


def _conv_bwd_data(L, dy, dx, mask, x_shape, workspace=None):
    """kernels.conv's, or kernels.winograd's with its `workspace`. mask: dx is the layer's
    input, a ReLU output, and the gradient goes over it masked by it (relu_mask)."""
    w, _ = L.params

    def run(a, stream):
        if workspace:
            winograd.conv2d_bwd_data(_get(a, dy), a[w], _get(a, dx), pad=1, relu_mask=mask,
                                     workspace=a[workspace], stream=stream)
        else:
            conv.conv2d_bwd_data(_get(a, dy), a[w], _get(a, dx), pad=1, relu_mask=mask,
                                 stream=stream)

    def ref(w, dy, *y):   # y: the ReLU output, read when masked
        g = conv.conv2d_bwd_data_ref(dy, w, x_shape, pad=1)
        return [relu.relu_bwd_ref(y[0], g) if mask else g]
    return run, ref


def _pool_fwd(x, y):
    def run(a, stream):
        pool.maxpool2x2(_get(a, x), _get(a, y), stream=stream)
    return run, lambda x: [pool.maxpool2x2_ref(x)]


def _pool_bwd(x, dy, dx, mask):
    """mask: dx is the pool's input, a ReLU output: the gradient goes over it, masked."""
    def run(a, stream):
        pool.maxpool2x2_bwd(_get(a, x), _get(a, dy), _get(a, dx), relu_mask=mask, stream=stream)

    def ref(x, dy):
        g = pool.maxpool2x2_bwd_ref(x, dy)
        return [relu.relu_bwd_ref(x, g) if mask else g]
    return run, ref


def _flat(x):
    """(B, ...) -> (B, features): the classifier's view of the last pooling output."""
    return x.reshape(x.shape[0], x.size // x.shape[0])


def _linear_fwd(L):
    w, b = L.params

    def run(a, stream):
        linear.linear(_flat(a[L.input]), a[w], a[b], a[L.output], relu=L.relu, stream=stream)
    return run, lambda x, w, b: [linear.linear_ref(_flat(x).astype(np.float64), w, b, relu=L.relu)]


def _linear_bwd_weight(L, dy):
    w, b = L.params

    def run(a, stream):
        linear.linear_bwd_weight(_flat(a[L.input]), a[dy], a[f"{w}.grad"], a[f"{b}.grad"], stream=stream)

    def ref(x, dy):
        dy = dy.astype(np.float64)
        return [dy.T @ _flat(x).astype(np.float64), dy.sum(0)]
    return run, ref


def _linear_bwd_data(L, dy, dx, x_shape):
    w, _ = L.params

    def run(a, stream):
        linear.linear_bwd_data(a[dy], a[w], _flat(a[dx]), stream=stream)
    return run, lambda w, dy: [(dy.astype(np.float64) @ w).reshape(x_shape)]


def _join(pieces, out, rows):
    """out = the micro-batches' pieces, `rows` each, stacked in order (device copies)."""
    def run(a, stream):
        for k, p in enumerate(pieces):
            graph.copy(a[out][k * rows:(k + 1) * rows], a[p], stream)
    return run, lambda *ps: [np.concatenate(ps)]


def _grad_sum(pieces, out):
    """out = the micro-batches' gradients summed in order: ((g0 + g1) + g2) + ..."""
    def run(a, stream):
        elementwise.add(a[pieces[0]], a[pieces[1]], a[out], stream=stream)
        for p in pieces[2:]:
            elementwise.add(a[out], a[p], a[out], stream=stream)

    return run, lambda *gs: [functools.reduce(np.add, gs)]   # float32 adds, in order


def _relu_bwd(y, dy, dx):
    def run(a, stream):
        relu.relu_bwd(a[y], a[dy], a[dx], stream=stream)
    return run, lambda y, dy: [relu.relu_bwd_ref(y, dy)]


def _loss(logits):
    def run(a, stream):
        xent.softmax_xent(a[logits], a["labels"], a["loss"], a[f"{logits}.grad"], stream=stream)
    return run, xent.softmax_xent_ref


def _sgd(p, cfg):
    def run(a, stream):
        sgd.sgd_step(a[p], a[f"{p}.grad"], a[f"{p}.momentum"], lr=cfg.lr, momentum=cfg.momentum,
                     weight_decay=cfg.weight_decay, stream=stream)
    return run, lambda p, g, v: sgd.sgd_ref(p, g, v, lr=cfg.lr, momentum=cfg.momentum,
                                            weight_decay=cfg.weight_decay)


def initial_values(cfg: VGGConfig, state: dict, images: np.ndarray, labels: np.ndarray,
                   momentum: dict | None = None, *, allow_nonfinite: bool = False
                   ) -> dict[str, np.ndarray]:
    """Host values of every persistent tensor before the step: the batch, the parameters,
    zero gradients and the momentum buffers (zero unless given: a fresh optimizer). Weights,
    momentum and images must be finite unless `allow_nonfinite`."""
    B, S = cfg.batch, cfg.image_size
    images, labels = np.asarray(images), np.asarray(labels)
    if images.shape != (B, 3, S, S) or not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f"images: expected floats of shape {(B, 3, S, S)}, got "
                         f"{images.dtype} {images.shape}")
    if not allow_nonfinite and not np.isfinite(images).all():
        raise ValueError("images: non-finite values; pass allow_nonfinite=True to use them")
    if labels.shape != (B,) or not np.issubdtype(labels.dtype, np.integer) \
            or labels.min() < 0 or labels.max() >= cfg.num_classes:
        raise ValueError(f"labels: expected {B} integer class indices in [0, {cfg.num_classes}), "
                         f"got {labels.dtype} {labels.shape}"
                         + (f", range [{labels.min()}, {labels.max()}]" if labels.size else ""))
    params = load_state_dict(cfg, state, allow_nonfinite=allow_nonfinite)
    if momentum is not None:
        momentum = checked_params(param_shapes(cfg), momentum, what=f"VGG-{cfg.depth} momentum",
                                  allow_nonfinite=allow_nonfinite)
    values = {"images": np.ascontiguousarray(images, np.float32),
              "labels": np.ascontiguousarray(labels, np.int32)}
    for name, p in params.items():
        values[name] = p
        values[f"{name}.grad"] = np.zeros_like(p)
        values[f"{name}.momentum"] = (np.zeros_like(p) if momentum is None
                                      else np.ascontiguousarray(momentum[name], np.float32))
    return values


# ---------------------------------------------------------------------------- reference
@dataclasses.dataclass
class StepResult:
    loss: float
    grads: dict[str, np.ndarray]      # by parameter name
    params: dict[str, np.ndarray]     # after the update
    momentum: dict[str, np.ndarray]   # after the update


def reference_step(cfg: VGGConfig, state: dict, images: np.ndarray, labels: np.ndarray,
                   momentum: dict | None = None) -> StepResult:
    """The same step in NumPy, from the kernels' float64 references (each stores float32, as
    the device does): forward, loss, backward, SGD."""
    values = initial_values(cfg, state, images, labels, momentum)
    act = {"images": values["images"]}
    net = layers(cfg)
    for L in net:
        x = act[L.input]
        if L.kind == "conv":
            act[L.output] = conv.conv2d_ref(x, values[L.params[0]], values[L.params[1]], pad=1, relu=True)
        elif L.kind == "pool":
            act[L.output] = pool.maxpool2x2_ref(x)
        else:
            act[L.output] = linear.linear_ref(x.reshape(cfg.batch, -1), values[L.params[0]],
                                              values[L.params[1]], relu=L.relu)
    loss, dy = xent.softmax_xent_ref(act[net[-1].output], values["labels"])
    grads = {}
    for L in reversed(net):
        x = act[L.input]
        if L.kind == "pool":
            dy = pool.maxpool2x2_bwd_ref(x, dy)
            continue
        if L.relu:
            dy = relu.relu_bwd_ref(act[L.output], dy)
        w, b = L.params
        if L.kind == "conv":
            grads[w], grads[b] = conv.conv2d_bwd_weight_ref(x, dy, values[w].shape, pad=1)
            dy = conv.conv2d_bwd_data_ref(dy, values[w], x.shape, pad=1)
        else:
            dx, grads[w], grads[b] = linear.linear_bwd_ref(x.reshape(cfg.batch, -1), values[w], dy)
            dy = dx.reshape(x.shape)
    params, velocity = {}, {}
    for name in param_shapes(cfg):
        params[name], velocity[name] = sgd.sgd_ref(
            values[name], grads[name], values[f"{name}.momentum"], lr=cfg.lr,
            momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return StepResult(float(loss), grads, params, velocity)
