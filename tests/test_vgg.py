"""VGG as a Tape: naming and loading as torchvision, exact reads/writes, and one SGD step run op
by op on plainly allocated device arrays equal to the NumPy reference step."""

import dataclasses

import numpy as np
import pytest

from proto.device import backend
from proto.device.backend import cuda
from proto.models import vgg

# The smallest VGG that still has every layer kind: 5 pools take 32x32 to 1x1. Its classifier
# is narrow because the simulator pays per GEMM thread; the GPU checks a wider VGG-16.
TINY = vgg.VGGConfig(depth=11, width=1 / 16, image_size=32, batch=2, num_classes=10,
                     lr=0.1, momentum=0.9, weight_decay=5e-4, hidden=32)
GPU_CFG = vgg.VGGConfig(depth=16, width=1 / 8, image_size=32, batch=4, num_classes=10,
                        lr=0.1, momentum=0.9, weight_decay=5e-4)


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    S = cfg.image_size
    images = rng.standard_normal((cfg.batch, 3, S, S)).astype(np.float32)
    return images, rng.integers(0, cfg.num_classes, cfg.batch).astype(np.int32)


def run_unconstrained(tape, arrays, *, check_access=False):
    """Run every op in order with all tensors resident (the no-policy baseline).

    check_access: each op sees only the arrays it declares (an undeclared one is a KeyError);
    tensors it only writes start as NaN and must come out fully written; tensors it only
    reads must come out unchanged.
    """
    for op in tape.ops:
        view = {n: arrays[n] for n in op.reads + op.writes}
        if not check_access:
            op.run(view, 0)
            continue
        only_read = {n: arrays[n].copy_to_host() for n in op.reads if n not in op.writes}
        for n in op.writes:
            if n not in op.reads:
                arrays[n].copy_to_device(np.full(arrays[n].shape, np.nan, arrays[n].dtype))
        op.run(view, 0)
        for n in op.writes:
            assert not np.isnan(arrays[n].copy_to_host()).any(), f"{op.name} left part of {n} unwritten"
        for n, before in only_read.items():
            np.testing.assert_array_equal(arrays[n].copy_to_host(), before,
                                          err_msg=f"{op.name} changed {n}, which it only reads")


def _device_arrays(tape, values):
    arrays = {}
    for name, spec in tape.tensors.items():
        host = values.get(name, np.zeros(spec.shape, spec.dtype))
        assert host.shape == spec.shape and host.dtype == spec.dtype, name
        arrays[name] = cuda.to_device(host)
    return arrays


def test_names_and_shapes_follow_torchvision():
    cfg = vgg.VGGConfig(depth=16)
    shapes = vgg.param_shapes(cfg)
    convs = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("features")})
    assert convs == [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]
    assert shapes["features.28.weight"] == (512, 512, 3, 3)
    assert shapes["classifier.0.weight"] == (4096, 512 * 7 * 7)
    assert shapes["classifier.6.weight"] == (1000, 4096)
    small = vgg.param_shapes(vgg.VGGConfig(depth=19, width=1 / 8, image_size=64, num_classes=10))
    assert small["features.0.weight"] == (8, 3, 3, 3)
    assert small["classifier.0.weight"] == (512, 64 * 2 * 2)   # flatten of a 2x2 map
    assert len([k for k in small if k.endswith("weight")]) == 16 + 3


def test_loading_rejects_misshaped_missing_and_unexpected_keys():
    state = vgg.random_state_dict(TINY)
    assert vgg.load_state_dict(TINY, state).keys() == state.keys()
    bad = dict(state, **{"features.3.weight": np.zeros((8, 4, 1, 1), np.float32)})
    with pytest.raises(ValueError, match=r"features.3.weight.*expected shape \(8, 4, 3, 3\)"):
        vgg.load_state_dict(TINY, bad)
    with pytest.raises(ValueError, match="missing"):
        vgg.load_state_dict(TINY, {k: v for k, v in state.items() if k != "classifier.6.bias"})
    with pytest.raises(ValueError, match="unexpected"):
        vgg.load_state_dict(TINY, dict(state, **{"features.30.weight": state["features.0.weight"]}))


def test_config_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="image_size: expected a multiple of 32"):
        vgg.VGGConfig(image_size=48)
    with pytest.raises(ValueError, match="depth"):
        vgg.VGGConfig(depth=12)
    with pytest.raises(ValueError, match="convolution: expected one of"):
        vgg.VGGConfig(convolution="fft")
    with pytest.raises(ValueError, match="winograd_min_channels: expected a positive integer"):
        vgg.VGGConfig(convolution="winograd", winograd_min_channels=0)
    with pytest.raises(ValueError, match="front_splits: expected a divisor of batch=32"):
        vgg.VGGConfig(batch=32, front_splits=3)
    with pytest.raises(ValueError, match="front_splits: expected a positive integer"):
        vgg.VGGConfig(front_splits=0)


def test_the_first_block_in_micro_batches_moves_its_activations_in_pieces():
    """front_splits=4 at VGG-19's 224x224 (described, not run): conv1's outputs become four
    quarter-batch tensors, and so does the first pool's, joined into the whole one that conv2
    reads; every other tensor but the block's workspaces keeps its shape, each first-block op
    runs once a micro-batch on a quarter of the work, and the peak of live bytes does not
    grow."""
    big = vgg.VGGConfig(depth=19, batch=8)
    whole, split = vgg.build_tape(big), vgg.build_tape(dataclasses.replace(big, front_splits=4))
    for name in ("features.0.out", "features.2.out", "features.4.out"):
        assert (name in split.tensors) == (name == "features.4.out")
        pieces = [split.tensors[f"{name}.mb{k}"] for k in range(4)]
        assert all(p.shape == (2,) + whole.tensors[name].shape[1:] for p in pieces)
    # The first block's workspaces are sized for a micro-batch: on the GPU the direct weight
    # gradient splits its reduction by the batch it sees, so they may shrink, never grow.
    first = {n for n in whole.tensors if n.startswith(("features.0.", "features.2."))
             and whole.tensors[n].kind == "workspace"}
    assert all(split.tensors[n].nbytes <= whole.tensors[n].nbytes for n in first
               if n in split.tensors)
    rest = {n for n in whole.tensors if n not in ("features.0.out", "features.2.out", *first)}
    assert all(split.tensors[n] == whole.tensors[n] for n in rest)
    join = next(op for op in split.ops if op.name == "features.4.join")
    assert join.reads == tuple(f"features.4.out.mb{k}" for k in range(4))
    assert join.writes == ("features.4.out",)
    assert split.ops.index(join) == max(i for i, op in enumerate(split.ops) if ".mb" in op.name
                                        and op.phase == "forward") + 1
    flops = {op.name: op.flops for op in whole.ops}
    for op in split.ops:
        if ".mb" in op.name:
            layer_op = op.name.replace(op.name.split(".")[2] + ".", "", 1)   # drop ".mbK"
            assert op.flops == pytest.approx(flops[layer_op] / 4), op.name
    # the parameter gradients of the first block: four pieces, summed in order, before SGD
    sums = [op for op in split.ops if op.name.endswith(".grad_sum")]
    assert [op.name for op in sums] == [f"features.{i}.{p}.grad_sum" for i in (0, 2)
                                        for p in ("weight", "bias")]
    for op in sums:
        p = op.writes[0]
        assert op.reads == tuple(f"{p}.mb{k}" for k in range(4))
    from proto.vm import Liveness
    assert Liveness(split).peak <= Liveness(whole).peak


@pytest.mark.parametrize("depth", [11, 19])
def test_winograd_runs_only_where_both_channel_counts_reach_the_threshold(depth):
    """Describing the tape launches nothing, so the full-width model is cheap to build here."""
    cfg = vgg.VGGConfig(depth=depth, image_size=32, batch=1, convolution="winograd")
    tape = vgg.build_tape(cfg)
    ops_with_ws = {}
    for op in tape.ops:
        for n in op.writes:
            if n.endswith("_winograd"):
                ops_with_ws.setdefault(op.layer, set()).add(n.split(".")[-1])
    # torchvision's configurations written out ("M" a pool); torchvision numbers a conv and
    # its ReLU as two modules, a pool as one
    widths = {11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
              19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
                   512, 512, 512, 512, "M"]}[depth]
    expected, index, cin = set(), 0, 3
    for w in widths:
        if w == "M":
            index += 1
            continue
        if min(cin, w) >= 128:   # the default threshold
            expected.add(f"features.{index}")
        cin, index = w, index + 2
    assert set(ops_with_ws) == expected
    assert all(kinds == {"fwd_winograd", "bwd_data_winograd", "bwd_weight_winograd"}
               for kinds in ops_with_ws.values())


def test_tape_lifetimes_are_explicit():
    tape = vgg.build_tape(TINY)
    writers = {}
    for i, op in enumerate(tape.ops):
        for n in op.writes:
            writers.setdefault(n, []).append(i)
    for name, spec in tape.tensors.items():
        uses = tape.uses(name)
        assert uses, f"{name} is declared but no op touches it"
        if spec.kind == "activation":
            # born by a write (no op reads garbage)
            assert writers[name][0] == uses[0] and name not in tape.ops[uses[0]].reads, name
            # Every later write is in place (the writer reads the tensor too) and in backward,
            # so the forward writes each tensor once and re-running its producer recomputes it.
            later = [tape.ops[i] for i in writers[name][1:]]
            assert all(name in op.reads and op.phase == "backward" for op in later), name
            if name.endswith(".grad"):   # a linear ReLU layer's: masked by its ReLU backward
                assert [op.name for op in later] == [
                    op.name for op in tape.ops
                    if op.name.endswith(".relu_bwd") and op.reads[0] + ".grad" == name], name
            elif later:   # a conv output: its gradient goes over it, once, masked by it
                assert len(later) == 1, name
                assert later[0].name.endswith((".bwd_data", ".bwd")), name
    conv_outputs = {f"{L.name}.out" for L in vgg.layers(TINY) if L.kind == "conv"}
    assert conv_outputs == {n for n, ws in writers.items() if len(ws) == 2 and not n.endswith(".grad")}
    assert not [op for op in tape.ops if op.name.endswith(".relu_bwd")
                and not op.name.startswith("classifier.")]

    def readers(name):
        return [op.name for op in tape.ops if name in op.reads]
    # A pool output is read again only by the next conv's weight gradient. A conv output
    # (after its fused ReLU) is read by the next layer's forward and backward (which writes its
    # gradient over it), then, as that gradient, by its own layer's backward.
    assert readers("features.5.out") == ["features.6.fwd", "features.6.bwd_weight"]
    assert readers("features.3.out") == ["features.5.fwd", "features.5.bwd",
                                         "features.3.bwd_weight", "features.3.bwd_data"]
    assert readers("features.6.out") == ["features.8.fwd", "features.8.bwd_weight",
                                         "features.8.bwd_data", "features.6.bwd_weight",
                                         "features.6.bwd_data"]
    assert readers("features.3.weight") == ["features.3.fwd", "features.3.bwd_data", "features.3.weight.sgd"]
    assert tape.ops[-1].phase == "update" and {op.phase for op in tape.ops} == \
        {"forward", "loss", "backward", "update"}
    assert all(op.flops > 0 and op.layer for op in tape.ops)


# The first block in micro-batches with Winograd's kernels on the GPU; on the simulator, where
# a Winograd step takes twice a direct one, with the direct kernels.
@pytest.mark.parametrize("convolution, front_splits",
                         [("direct", 1), ("winograd", 1),
                          ("direct" if backend.SIMULATOR else "winograd", 2)])
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_tape_step_matches_numpy_reference(convolution, front_splits):
    """The whole step on the device, op by op, each op seeing only what it declares (Winograd's
    workspaces too: written whole, never read by another op); with the first block in two
    micro-batches, its parameter gradients summed."""
    # Winograd in every 3x3 layer but the first on the GPU (its default needs 128 channels,
    # more than these have). The simulator's time goes by threads simulated: there the model
    # is half TINY's width (2-16 channels) and Winograd runs in its three 16-channel layers
    # (4x4 and 2x2 images: padded tiles), forward, backward-data and weight gradient.
    cfg = dataclasses.replace(dataclasses.replace(TINY, width=1 / 32) if backend.SIMULATOR
                              else GPU_CFG, convolution=convolution,
                              winograd_min_channels=16 if backend.SIMULATOR else 1,
                              front_splits=front_splits)
    state = vgg.random_state_dict(cfg, seed=1)
    images, labels = _batch(cfg)
    rng = np.random.default_rng(2)
    momentum = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in state.items()}
    tape = vgg.build_tape(cfg)
    workspaces = {n for n, t in tape.tensors.items() if t.kind == "workspace"}
    assert any(n.endswith("_winograd") for n in workspaces) == (convolution == "winograd")
    assert any(".mb1." in op.name for op in tape.ops) == (front_splits > 1)
    arrays = _device_arrays(tape, vgg.initial_values(cfg, state, images, labels, momentum))
    run_unconstrained(tape, arrays, check_access=True)
    ref = vgg.reference_step(cfg, state, images, labels, momentum)

    np.testing.assert_allclose(arrays["loss"].copy_to_host()[0], ref.loss, rtol=1e-5)
    # Gradients: float32 sums of up to N*P*Q = 2048 (GPU: 4096) products in every layer, against a
    # float64-accumulated reference that stores float32 between layers as the device does;
    # relative error ~1e-5 per layer. atol 1e-4 of each tensor's largest value, rtol 1e-3.
    for name in vgg.param_shapes(cfg):
        g = ref.grads[name]
        atol = 1e-4 * np.abs(g).max()
        np.testing.assert_allclose(arrays[f"{name}.grad"].copy_to_host(), g, rtol=1e-3,
                                   atol=atol, err_msg=name)
        np.testing.assert_allclose(arrays[f"{name}.momentum"].copy_to_host(), ref.momentum[name],
                                   rtol=1e-3, atol=atol, err_msg=name)
        np.testing.assert_allclose(arrays[name].copy_to_host(), ref.params[name], rtol=1e-5,
                                   atol=1e-6 + cfg.lr * atol, err_msg=name)
    assert np.abs(ref.grads["features.0.weight"]).max() > 0   # the gradient reached the input layer


def test_torchvision_state_dict_loads():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.vgg11()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = vgg.load_state_dict(vgg.VGGConfig(depth=11), state)
    assert params["classifier.0.weight"].shape == (4096, 25088)


def test_reference_step_matches_pytorch():
    """The reference (and so, through the test above, the tape) is PyTorch's step: a torch
    model with the same module indices, CrossEntropyLoss, and torch.optim.SGD."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    cfg = TINY
    state = vgg.random_state_dict(cfg, seed=3)
    images, labels = _batch(cfg, seed=4)
    features, c = [], 3
    for v in vgg.CONFIGS[cfg.depth]:
        if v == "M":
            features.append(nn.MaxPool2d(2, 2))
        else:
            features += [nn.Conv2d(c, cfg.channels(v), 3, padding=1), nn.ReLU(inplace=True)]
            c = cfg.channels(v)
    h = cfg.hidden
    model = nn.Module()
    model.features = nn.Sequential(*features)
    model.classifier = nn.Sequential(nn.Linear(c, h), nn.ReLU(True), nn.Dropout(0.0), nn.Linear(h, h),
                                     nn.ReLU(True), nn.Dropout(0.0), nn.Linear(h, cfg.num_classes))
    model.double().load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    x = torch.from_numpy(images.astype(np.float64))
    loss = nn.functional.cross_entropy(model.classifier(model.features(x).flatten(1)),
                                       torch.from_numpy(labels.astype(np.int64)))
    loss.backward()
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
    opt.step()
    ref = vgg.reference_step(cfg, state, images, labels)
    assert np.isclose(ref.loss, loss.item(), rtol=1e-5)
    for name, p in model.named_parameters():
        atol = 1e-4 * np.abs(grads[name]).max()   # the reference stores float32 between layers
        np.testing.assert_allclose(ref.grads[name], grads[name], rtol=1e-3, atol=atol, err_msg=name)
        np.testing.assert_allclose(ref.params[name], p.detach().numpy(), rtol=1e-5,
                                   atol=1e-6 + cfg.lr * atol, err_msg=name)


@pytest.mark.parametrize("front_splits", [1, 2])
def test_host_math_changes_only_how_ops_compute_and_matches_the_numpy_reference(front_splits):
    """build_tape(host_math=True), the simulator's fast tape: the same tensors, ops, reads and
    writes, each op computed from its kernels' NumPy references; the step still equals the
    reference step (which is written layer by layer, not op by op, at the whole batch)."""
    cfg = dataclasses.replace(TINY, front_splits=front_splits)
    tape, host = vgg.build_tape(cfg), vgg.build_tape(cfg, host_math=True)
    assert host.tensors == tape.tensors
    assert [(o.name, o.phase, o.reads, o.writes, o.flops, o.layer) for o in host.ops] == \
        [(o.name, o.phase, o.reads, o.writes, o.flops, o.layer) for o in tape.ops]
    assert all(a.run is not b.run for a, b in zip(host.ops, tape.ops))
    state = vgg.random_state_dict(cfg, seed=1)
    images, labels = _batch(cfg)
    arrays = _device_arrays(host, vgg.initial_values(cfg, state, images, labels))
    run_unconstrained(host, arrays)
    ref = vgg.reference_step(cfg, state, images, labels)
    np.testing.assert_allclose(arrays["loss"].copy_to_host()[0], ref.loss, rtol=1e-6)
    for name in vgg.param_shapes(cfg):   # the same float64 references, float32 between ops
        atol = 1e-6 * np.abs(ref.grads[name]).max()
        np.testing.assert_allclose(arrays[f"{name}.grad"].copy_to_host(), ref.grads[name],
                                   rtol=1e-5, atol=atol, err_msg=name)
        np.testing.assert_allclose(arrays[name].copy_to_host(), ref.params[name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_host_math_cannot_be_recorded_into_a_graph():
    from proto import graph
    host = vgg.build_tape(TINY, host_math=True)
    arrays = _device_arrays(host, {})
    op = host.ops[0]
    with pytest.raises(RuntimeError, match="computes on the host"):
        with graph.record():
            op.run({n: arrays[n] for n in op.reads + op.writes}, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("convolution, front_splits",
                         [("direct", 1), ("winograd", 1), ("winograd", 2)])
def test_memory_policies_give_identical_bits_on_the_gpu(convolution, front_splits):
    # Every kernel of the step is deterministic (the conv weight gradient's split reduction
    # is summed in a fixed order), so a policy that leaves the math alone gives equal bits:
    # a rerun, the AutoVM schedule, the schedule as one CUDA graph, and demand paging.
    from proto.vm import Executor, Liveness, PagingExecutor, plan
    cfg = dataclasses.replace(GPU_CFG, convolution=convolution, winograd_min_channels=1,
                              front_splits=front_splits)
    tape = vgg.build_tape(cfg)
    assert any(t.kind == "workspace" for t in tape.tensors.values()), "expected a workspace"
    images, labels = _batch(cfg)
    init = vgg.initial_values(cfg, vgg.random_state_dict(cfg, seed=0), images, labels)
    names = ["loss"] + [f"{p}.grad" for p in vgg.param_shapes(cfg)]

    def run(ex, capture=False):
        with ex:
            if capture:
                ex.load(init)
                ex.capture()
            ex.load(init)
            ex.step()
            return ex.read_many(names)

    want = run(Executor(tape, plan(tape)))
    budget = int(0.5 * Liveness(tape).peak)
    swap = plan(tape, budget)
    assert swap.offloaded or swap.homed
    for label, got in [("rerun", run(Executor(tape, plan(tape)))),
                       ("autovm 50%", run(Executor(tape, swap))),
                       ("graphed autovm 50%", run(Executor(tape, plan(tape, budget)), capture=True)),
                       ("paging 50%", run(PagingExecutor(tape, budget, page_bytes=1 << 16)))]:
        for name in names:
            assert np.array_equal(got[name], want[name]), f"{label}: {name} differs"
