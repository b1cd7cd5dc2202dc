"""FP8 gradient all-reduce of a bucket (fp8amp.distributed's hook, docs/distributed.md#design): 1, 2
and 3 processes on CPU with gloo, and 1 and 2 processes on as many GPUs with NCCL (rank r on cuda:r;
marked gpu, skipped with fewer GPUs); and, in one process, the bucket's layout and its pipelined
chunks (fp8amp.comm_layout).

Each setup spawns its processes once (a module fixture, comm_ranks.py); the workers run every
scenario and hand back their inputs and outputs (on the CPU); the tests below check them against
the exact float64 mean (the derived bounds) and, bit for bit, against reference_mean (the algorithm
written out plainly, in one process). The scenarios are the same on both backends, except for
method "native": gloo cannot reduce float8, so there it must raise and NCCL's float8 SUM is
emulated; NCCL runs its own. On CUDA one more scenario checks the ordering of the side stream
against the compute stream.

The exact mean, its derived bound (method "all_to_all") and the plain reference algorithm are in
comm_reference.py. The hook under DDP, all_reduce_grads on whole models and the arguments' errors
are in test_distributed_models.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

import fp8amp

from cast_reference import assert_bits_equal
from comm_ranks import FOUR_RANKS, SETUPS, mlp, run_hook, spawn
from comm_reference import (E4M3, E5M2, U, ETA, U32, synth, FakeBucket, pow2_scale, bound_all_to_all, native_fmax,
                            headroom_worst, shard_pieces, emulated_native, reference_mean, amax_input_dtypes,
                            cut_at_chunks)
from fp8amp import comm_layout
from fp8amp import distributed as fd

SIZES = (37, 1, 200, 5, 64)  # 307 elements: not a multiple of 2 or 3
CHUNKS = 3  # pipelined chunks of SIZES' bucket: [0, 128), [128, 256), [256, 307), cutting gradients 2 and 4
# A kernel spinning this many GPU clock cycles (about half a second on an H200) keeps the compute
# stream busy far longer than the host needs to queue a whole reduction.
SLEEP_CYCLES = 10**9


# ----------------------------------------------------------------------------- the workers


def native_runs(rank, world, device) -> dict:
    """Method "native" in both formats: the gradients of SIZES, and the headroom's worst case."""
    out = {}
    for fmt in (E4M3, E5M2):
        state = fd.FP8CommState(fmt=fmt, method="native")
        out["native", fmt] = run_hook(synth(rank, SIZES, torch.float32), SIZES, state, device)
        out["native_worst", fmt] = run_hook(headroom_worst(rank, world, fmt), (9,), state, device)
    return out


def emulated_native_runs(rank, world, backend, device) -> dict:
    """Method "native" with the emulated FP8 SUM, whose result reference_mean knows bit for bit, in
    both formats for float32 and bfloat16 buckets (on NCCL too: its own SUM need not round as the
    emulation does)."""
    out = {}
    with emulated_native(backend):
        for fmt in (E4M3, E5M2):
            for dtype in (torch.float32, torch.bfloat16):
                state = fd.FP8CommState(fmt=fmt, method="native")
                out["native_emulated", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
                for per_chunk in (True, False, None):
                    state = fd.FP8CommState(fmt=fmt, method="native", pipeline_chunks=CHUNKS, scales_per_chunk=per_chunk)
                    out["native_emulated_chunked", fmt, dtype, per_chunk] = run_hook(synth(rank, SIZES, dtype), SIZES,
                                                                                     state, device)
        bad = synth(rank, SIZES, torch.float32)
        if rank == world - 1:
            bad[300] = float("inf")  # in the last chunk: known only after the first chunks are quantized
        state = fd.FP8CommState(method="native", pipeline_chunks=CHUNKS, scales_per_chunk=True)
        out["native_emulated_chunked_inf"] = run_hook(bad, SIZES, state, device)
    return out


def stream_order_run(rank, device) -> dict:
    """CUDA only: the hook and all_reduce_grads called while the compute stream is still busy (a
    spinning kernel, then the write of their input), their results used on the compute stream at
    once; then again on an idle GPU, as the reference. A side stream that did not wait for the
    compute stream would read the input before it is written, and a result used without waiting
    for the side stream would be read before it is written: either differs from the reference. The
    busy call goes first and its data (seeds 2, 3) appears nowhere else, so a result read too early
    cannot find the right bytes in a reused memory block. Also records whether each busy call
    returned to the host while the GPU was still busy (no host synchronization)."""
    compute = torch.cuda.current_stream(device)
    state = fd.FP8CommState(method="all_to_all")  # the bound the test checks
    x = synth(rank, SIZES, torch.float32, seed=2).to(device)
    bucket = torch.zeros_like(x)
    model = mlp().to(device)
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    grads = synth(rank, numels, torch.float32, seed=3).to(device).split(numels)
    for p in params:
        p.grad = torch.zeros_like(p)

    def hook():
        bucket.copy_(x)
        return fd.fp8_allreduce_hook(state, FakeBucket(bucket, SIZES)).wait().clone()

    def all_reduce_grads():
        for p, g in zip(params, grads):
            p.grad.copy_(g.view_as(p))
        fd.all_reduce_grads(model, state)
        return [p.grad.clone() for p in params]

    # The first all_reduce_grads makes the gloo group its layout check runs over (a collective of
    # every rank): done here, on zeros, so that the busy calls show the steady state, whose check
    # goes host to host and waits for no GPU work.
    fd.all_reduce_grads(model, state)
    out = {}
    for name, call in (("hook", hook), ("grads", all_reduce_grads)):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(SLEEP_CYCLES)
        out[name + "_busy"] = call()
        out[name + "_returned_early"] = not compute.query()
        torch.cuda.synchronize(device)
        out[name + "_idle"] = call()
    return out


def fp8_grads(rank, device, nan_code=False) -> list:
    """The gradients of an O1/O2 bucket for SIZES: FP8 ScaledTensors (E4M3 and one E5M2, current
    scaling, as the weight gradients) and float32 ones (a bias); ``nan_code``: one NaN code."""
    xs = synth(rank, SIZES, torch.float32, seed=4).to(device).split(SIZES)
    fmts = (E4M3, None, E4M3, E5M2, E4M3)
    grads = [x.clone() if f is None else fp8amp.ScaledTensor.from_tensor(x, f) for x, f in zip(xs, fmts)]
    if nan_code:
        grads[2].codes.view(torch.uint8)[7] = 0x7F
    return grads


def bucket_of(grads) -> torch.Tensor:
    """What DDP copies into a float32 bucket: each gradient's values."""
    return torch.cat([g.dequantize() if isinstance(g, fp8amp.ScaledTensor) else g for g in grads])


def fp8_grad_runs(rank, world, backend, device) -> dict:
    """O1/O2 buckets: the hook given the parameters' FP8 gradients reads their amaxes from the codes;
    the same bucket without them reads the bucket; all_to_all, native (emulated on gloo), chunked."""
    out = {}
    grads = fp8_grads(rank, device)
    native = contextlib.nullcontext() if backend == "nccl" else emulated_native(backend)
    for name, kwargs in (("all_to_all", dict(method="all_to_all")), ("native", dict(method="native")),
                         ("chunked", dict(method="all_to_all", pipeline_chunks=CHUNKS))):
        with native if name == "native" else contextlib.nullcontext():
            seen = set()
            with amax_input_dtypes(seen):
                out["codes", name] = fd.fp8_allreduce_hook(
                    fd.FP8CommState(**kwargs), FakeBucket(bucket_of(grads), SIZES, grads)).wait()
            out["codes_read", name] = sorted(seen)
            out["bucket", name] = fd.fp8_allreduce_hook(fd.FP8CommState(**kwargs),
                                                        FakeBucket(bucket_of(grads), SIZES)).wait()
    bad = fp8_grads(rank, device, nan_code=rank == world - 1)
    out["codes_nan"] = fd.fp8_allreduce_hook(fd.FP8CommState(method="all_to_all"),
                                             FakeBucket(bucket_of(bad), SIZES, bad)).wait()
    return out


def wide_range(rank: int) -> torch.Tensor:
    """300 elements of one sign: about 1e3 in [0, 128) (the first of 3 chunks), about 1e-6 after."""
    g = torch.Generator().manual_seed(rank)
    x = 1 + torch.rand(300, generator=g)
    x[:128] *= 1e3
    x[128:] *= 1e-6
    return x


def worker(rank: int, world: int, backend: str, device: torch.device) -> dict:
    """Every scenario of the hook on one rank (comm_ranks.spawn runs it in each process)."""
    res = {"fp8_grads": fp8_grad_runs(rank, world, backend, device)}
    for fmt in (E4M3, E5M2):
        for dtype in (torch.float32, torch.bfloat16):
            state = fd.FP8CommState(fmt=fmt, method="all_to_all")
            res["hook", fmt, dtype] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
    for fmt, dtype in ((E4M3, torch.float32), (E5M2, torch.bfloat16)):
        for per_chunk in (True, False, None):
            state = fd.FP8CommState(fmt=fmt, method="all_to_all", pipeline_chunks=CHUNKS, scales_per_chunk=per_chunk)
            res["chunked", fmt, dtype, per_chunk] = run_hook(synth(rank, SIZES, dtype), SIZES, state, device)
    for per_chunk in (True, False):
        state = fd.FP8CommState(method="all_to_all", pipeline_chunks=CHUNKS, scales_per_chunk=per_chunk)
        res["wide_range", per_chunk] = run_hook(wide_range(rank), (300,), state, device)
    for key, where, value in (("chunked_inf", 20, float("inf")), ("chunked_nan", 300, float("nan"))):
        bad = synth(rank, SIZES, torch.float32)
        if rank == world - 1:
            bad[where] = value  # in the first chunk, then in the last
        state = fd.FP8CommState(method="all_to_all", pipeline_chunks=CHUNKS, scales_per_chunk=True)
        res[key] = run_hook(bad, SIZES, state, device)
    res["auto"] = run_hook(synth(rank, SIZES, torch.float32), SIZES, None, device)  # the default state
    state = fd.FP8CommState(method="all_to_all")
    res["one_gradient"] = run_hook(synth(rank, (301,), torch.float32), (301,), state, device)
    res["tiny"] = run_hook(synth(rank, (1,), torch.float32, seed=1), (1,), state, device)  # fewer elements than ranks
    res["zeros"] = run_hook(torch.zeros(11), (4, 7), state, device)
    bad = synth(rank, SIZES, torch.float32)
    if rank == world - 1:
        bad[40] = float("inf")
    res["inf"] = run_hook(bad, SIZES, state, device)
    bad = synth(rank, SIZES, torch.float32)
    if rank == 0:
        bad[250] = float("nan")
    res["nan"] = run_hook(bad, SIZES, state, device)
    if backend == "gloo":
        # gloo cannot reduce float8, so "native" must raise; then emulated, to check the scales.
        try:
            run_hook(synth(rank, SIZES, torch.float32), SIZES, fd.FP8CommState(method="native"), device)
        except ValueError as e:
            res["native_error"] = str(e)
        with emulated_native(backend):
            res.update(native_runs(rank, world, device))
    else:
        try:
            res.update(native_runs(rank, world, device))  # NCCL's own float8 SUM
            # A group made without naming a backend (init_process_group() under torchrun) has one
            # backend per device type; "native" must find NCCL for CUDA tensors.
            per_device = dist.new_group(backend="cpu:gloo,cuda:nccl")
            res["native_per_device_group"] = run_hook(synth(rank, SIZES, torch.float32), SIZES,
                                                      fd.FP8CommState(per_device, method="native"), device)
        except ValueError as e:  # a torch or NCCL build without float8 reductions
            res["native_error"] = str(e)
    res.update(emulated_native_runs(rank, world, backend, device))
    if device.type == "cuda":
        res["streams"] = stream_order_run(rank, device)
    return res


@pytest.fixture(scope="module", params=SETUPS + [FOUR_RANKS])
def run(request):
    return spawn(worker, *request.param)


def same_on_all_ranks(res, key):
    for r in res[1:]:
        a, b = res[0][key], r[key]
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), key


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hook_within_derived_bound(run, fmt, dtype):
    world, _, res = run
    key = ("hook", fmt, dtype)
    xs = [synth(r, SIZES, dtype).double() for r in range(world)]
    m, bound = bound_all_to_all(xs, SIZES, fmt, shard_pieces(SIZES, world))
    for r in res:
        out = r[key]
        assert out.dtype == dtype and out.shape == (sum(SIZES),)
        err = (out.double() - m).abs()
        assert (err <= bound).all(), (err - bound).max()
    same_on_all_ranks(res, key)
    # It is FP8 on the wire, not a float32 all-reduce: most elements are rounded.
    assert ((res[0][key].double() - m).abs() > 1e-4 * m.abs()).float().mean() > 0.5


def test_hook_single_gradient_and_fewer_elements_than_ranks(run):
    world, _, res = run
    for key, sizes, seed in (("one_gradient", (301,), 0), ("tiny", (1,), 1)):
        xs = [synth(r, sizes, torch.float32, seed=seed) for r in range(world)]
        m, bound = bound_all_to_all([x.double() for x in xs], sizes, E4M3, shard_pieces(sizes, world))
        expected = reference_mean(xs, sizes, E4M3, "all_to_all")
        for r in res:
            assert ((r[key].double() - m).abs() <= bound).all(), key
            assert_bits_equal(r[key], expected)
        same_on_all_ranks(res, key)


@pytest.mark.parametrize("method", fd.METHODS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hook_equals_plain_reference_bit_for_bit(run, method, fmt, dtype):
    """The hook's fused local work (multi-tensor ops into preallocated views, the rank-order sum in
    place) gives the very bits of reference_mean, the algorithm written out plainly; "native" with
    the emulated FP8 SUM, whose rounding the reference knows. (The division by N is an IEEE
    division in the comm kernels on both devices, as the reference's on the CPU.)"""
    world, _, res = run
    key = ("hook", fmt, dtype) if method == "all_to_all" else ("native_emulated", fmt, dtype)
    expected = reference_mean([synth(r, SIZES, dtype) for r in range(world)], SIZES, fmt, method)
    for r in res:
        assert_bits_equal(r[key], expected)


@pytest.mark.parametrize("per_chunk", [True, False, None], ids=["scales-per-chunk", "scales-per-gradient", "automatic"])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16)], ids=["e4m3-fp32", "e5m2-bf16"])
def test_pipelined_chunks_equal_plain_reference_bit_for_bit(run, fmt, dtype, per_chunk):
    """A bucket reduced in pipelined chunks (each chunk's collective overlapping the next chunk's
    local work) gives the bits of the reference whose first scales are one per gradient part in
    each chunk (``scales_per_chunk=True``) or one per gradient (``False``, and the default ``None``
    for chunks this small); "all_to_all" cuts each chunk into its own shards, "native" sums element
    by element (with scales per gradient: the very bits of the unchunked reduction)."""
    world, _, res = run
    xs = [synth(r, SIZES, dtype) for r in range(world)]
    bounds = comm_layout.chunk_bounds(sum(SIZES), CHUNKS, "all_to_all")
    chunks = list(zip(bounds[:-1], bounds[1:]))
    assert chunks == [(0, 128), (128, 256), (256, 307)]
    sizes = cut_at_chunks(SIZES, chunks) if per_chunk is True else SIZES
    assert cut_at_chunks(SIZES, chunks) == (37, 1, 90, 110, 5, 13, 51)
    expected = reference_mean(xs, sizes, fmt, "all_to_all", chunks)
    m, bound = bound_all_to_all([x.double() for x in xs], sizes, fmt, shard_pieces(SIZES, world, chunks))
    for r in res:
        assert_bits_equal(r["chunked", fmt, dtype, per_chunk], expected)
        assert ((r["chunked", fmt, dtype, per_chunk].double() - m).abs() <= bound).all()
        assert_bits_equal(r["native_emulated_chunked", fmt, dtype, per_chunk], reference_mean(xs, sizes, fmt, "native"))


def test_scales_per_chunk_keep_a_part_far_below_its_gradients_largest(run):
    """One gradient of 300 elements in 3 chunks, its first chunk's part about 1e3, the rest about
    1e-6 (9 decades: more than E4M3's range). With one scale a gradient the small parts flush to
    zero; with a scale for each part they come back within two E4M3 roundings of the exact mean."""
    world, _, res = run
    exact = torch.stack([wide_range(r) for r in range(world)]).double().mean(0)
    for r in res:
        own, shared = r["wide_range", True].double(), r["wide_range", False].double()
        assert (shared[128:] == 0).all()
        assert ((own[128:] - exact[128:]).abs() <= 2 * 2.0 ** -4 * exact[128:].abs() + 1e-12).all()
        assert ((own[:128] - exact[:128]).abs() <= 2 * 2.0 ** -4 * exact[:128].abs()).all()


@pytest.mark.parametrize("method", ["all_to_all", "native", "chunked"])
def test_fp8_gradients_amaxes_read_from_codes_give_the_same_bits(run, method):
    """A float32 bucket of an O1/O2 model holds its FP8 gradients' dequantized values: the hook reads
    their amaxes from the codes (one byte an element), and the result is the very bits of the
    reduction that reads the bucket (amax(codes) * scale_inv rounds as amax(codes * scale_inv))."""
    _, _, res = run
    for r in res:
        out = r["fp8_grads"]
        assert out["codes_read", method] == ["torch.float32", "torch.float8_e4m3fn", "torch.float8_e5m2"]
        assert_bits_equal(out["codes", method], out["bucket", method])
    for r in res[1:]:
        assert_bits_equal(r["fp8_grads"]["codes", method], res[0]["fp8_grads"]["codes", method])


def test_fp8_gradient_with_a_nan_code_makes_every_rank_nan(run):
    """A NaN code in one rank's FP8 gradient, found through the codes, still reaches every rank."""
    _, _, res = run
    for r in res:
        assert r["fp8_grads"]["codes_nan"].isnan().all()


@pytest.mark.parametrize("key", ["chunked_inf", "chunked_nan", "native_emulated_chunked_inf"])
def test_pipelined_chunks_one_non_finite_makes_the_whole_bucket_nan(run, key):
    _, _, res = run
    for r in res:
        assert r[key].isnan().all(), key  # every chunk, on every rank


def test_auto_picks_native_on_nccl_up_to_two_ranks_else_all_to_all(run):
    """The default method: on NCCL with at most 2 ranks the bits of "native" (its float8 SUM),
    elsewhere those of "all_to_all"."""
    world, backend, res = run
    if backend == "nccl" and world <= fd.AUTO_NATIVE_MAX_RANKS and "native_error" not in res[0]:
        expected = [r["native", E4M3] for r in res]
    else:
        expected = [r["hook", E4M3, torch.float32] for r in res]
    for r, e in zip(res, expected):
        assert_bits_equal(r["auto"], e)


def test_zero_gradients_stay_zero(run):
    _, _, res = run
    for r in res:
        assert torch.equal(r["zeros"], torch.zeros(11))


@pytest.mark.parametrize("key", ["inf", "nan"])
def test_one_rank_non_finite_makes_every_rank_nan(run, key):
    _, _, res = run
    for r in res:
        assert r[key].isnan().all(), key  # the whole bucket, on every rank


def test_native_without_float8_reduction_raises_naming_methods(run):
    """gloo cannot reduce float8, so method "native" must raise, naming the methods; so must a torch
    or NCCL build that refuses float8 all_reduce."""
    _, backend, res = run
    if backend == "nccl" and "native_error" not in res[0]:
        pytest.skip("this torch and NCCL reduce float8: test_native_headroom_prevents_overflow_of_fp8_partial_sums "
                    "checks the result")
    for r in res:
        msg = r["native_error"]
        assert "'all_to_all'" in msg and "'native'" in msg
        if backend == "gloo":
            assert "'gloo'" in msg and "nccl" in msg


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_native_headroom_prevents_overflow_of_fp8_partial_sums(run, fmt):
    """NCCL's float8 SUM (gloo: emulated, FP8 partial sums, overflow -> NaN): every rank at the
    headroom's limit with the same sign must not overflow (a saturated sum would break the bound),
    and the result is within the native bound: one FP8 rounding of each contribution at the
    headroom scale s, N - 1 roundings of partial sums, the FP32 division."""
    world, backend, res = run
    if backend == "nccl" and "native_error" in res[0]:
        pytest.skip(f"this torch or NCCL refuses float8 all_reduce: {res[0]['native_error']}")
    u, eta = U[fmt], ETA[fmt]
    worst = torch.stack([headroom_worst(r, world, fmt).double() for r in range(world)])
    for key, x, sizes in ((("native_worst", fmt), worst, (9,)),
                          (("native", fmt), torch.stack([synth(r, SIZES, torch.float32).double() for r in range(world)]),
                           SIZES)):
        m = x.mean(0)
        s = torch.empty_like(m)
        o = 0
        for c in sizes:
            s[o:o + c] = pow2_scale(x[:, o:o + c].abs().max(), native_fmax(fmt, world))
            o += c
        q = (x.abs() * s * (1 + u) + eta).sum(0)  # sum over ranks of the codes' magnitudes
        err_codes = (u * x.abs() * s + eta).sum(0) + (world - 1) * (u * q * (1 + u) ** (world - 2) + eta)
        bound = err_codes / (s * world) + U32 * (m.abs() + err_codes / (s * world))
        for r in res:
            out = r[key].double()
            assert not out.isnan().any(), key
            assert ((out - m).abs() <= bound).all(), key
        same_on_all_ranks(res, key)


def test_native_finds_nccl_in_a_group_with_a_backend_per_device(run):
    _, backend, res = run
    if backend != "nccl" or "native_error" in res[0]:
        pytest.skip("NCCL's float8 SUM: the nccl2 setup, on a torch and NCCL that reduce float8")
    for r in res:
        assert torch.equal(r["native_per_device_group"], r["native", E4M3])  # same data, same NCCL sum


def test_cuda_side_stream_ordered_with_compute_stream(run):
    """The reduction waits for the compute stream's pending work, the compute stream for the
    reduction's result, and the host for neither (stream_order_run)."""
    world, backend, res = run
    if backend != "nccl":
        pytest.skip("CUDA streams: the nccl2 setup")
    xs = [synth(r, SIZES, torch.float32, seed=2).double() for r in range(world)]
    m, bound = bound_all_to_all(xs, SIZES, E4M3, shard_pieces(SIZES, world))
    for r in res:
        streams = r["streams"]
        assert streams["hook_returned_early"] and streams["grads_returned_early"]
        assert ((streams["hook_idle"].double() - m).abs() <= bound).all()
        assert torch.equal(streams["hook_busy"], streams["hook_idle"])
        for busy, idle in zip(streams["grads_busy"], streams["grads_idle"]):
            assert torch.equal(busy, idle)


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True, "4"])
def test_pipeline_chunks_must_be_none_or_a_positive_int(chunks):
    with pytest.raises(ValueError, match=r"pipeline_chunks must be None \(automatic\) or an int >= 1; got"):
        fd.FP8CommState(pipeline_chunks=chunks)


@pytest.mark.parametrize("n, chunks, method, count", [
    (307, 3, "native", 3), (1, 8, "native", 1), (100, 8, "all_to_all", 2), (2**24, None, "native", 1),
    (2**25 - 1, None, "native", 1), (2**25, None, "native", 2), (2**27, None, "native", 8),
    (2**29 + 5, None, "native", 8), (10**6, 1, "native", 1), (2**27, None, "all_to_all", 2),
    (2**29, None, "all_to_all", 8)])
def test_chunk_bounds_cover_the_bucket_aligned(n, chunks, method, count):
    bounds = comm_layout.chunk_bounds(n, chunks, method)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) - 1 == count
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert all(b % comm_layout.CHUNK_ALIGN == 0 for b in bounds[1:-1])
    if chunks is None:
        assert all(b - a >= comm_layout.PIPELINE_MIN_CHUNK[method] for a, b in zip(bounds[:-2], bounds[1:-1]))


@pytest.mark.parametrize("world", [2, 3, 8])
def test_layout_covers_every_element_once(world):
    sizes = (37, 1, 200, 5, 64)
    layout = comm_layout.make_layout(sizes, world)
    assert layout.L == math.ceil(sum(sizes) / world)
    covered = []
    for k in range(world):
        for a, b, i in layout.pieces[k]:
            o, c = layout.segments[i]
            assert o <= k * layout.L + a < k * layout.L + b <= o + c
            covered.extend(range(k * layout.L + a, k * layout.L + b))
    assert covered == list(range(sum(sizes)))


@pytest.mark.parametrize("n, chunks, asked, per_chunk", [
    (2**27, None, None, False), (2**29, None, None, True), (2**29 - 1024, None, None, False),
    (8 * comm_layout.PER_CHUNK_SCALES_MIN, None, None, True), (2**27, None, True, True), (2**29, None, False, False),
    (2**29, 1, True, False), (307, 3, True, True), (307, 3, None, False)])
def test_scales_per_chunk_by_default_only_where_chunks_are_large(n, chunks, asked, per_chunk):
    """FP8CommState(scales_per_chunk=None), the default: per chunk where a chunk holds at least
    PER_CHUNK_SCALES_MIN elements (smaller chunks' own amax launches make the host the bottleneck);
    True / False as asked in any chunked bucket; never in one chunk. wire_bytes follows the same rule
    (2^29 - 1024 elements: 8 chunks of 2^26 - 128)."""
    assert fd.FP8CommState().scales_per_chunk is None
    cut = comm_layout.make_chunks(comm_layout.make_layout((n,), 2), chunks, "native")
    assert comm_layout.uses_chunk_scales(cut, asked) is per_chunk
    if chunks is None:  # wire_bytes counts the automatic chunks
        assert fd.wire_bytes((n,), 2, "native", scales_per_chunk=asked) == n + 4 * (len(cut) if per_chunk else 1)
