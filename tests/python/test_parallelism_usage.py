"""Tensor, sequence and pipeline parallelism with fp8amp layers: 2 and 4 processes on CPU with gloo.

Tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``) of fp8amp layers is
not supported: Fp8Linear computes on local tensors, not DTensors. Each way in is refused up front,
by name, with what works (keep the tensor-parallel Linears ``nn.Linear`` through ``module_filter_fn``):
``convert`` / ``initialize`` of a model already tensor-parallel converted its DTensor Linears, whose
first forward failed inside a cast op ("mixed torch.Tensor and DTensor"; at O1/O2 the master's
quantize had "no sharding strategy"); ``parallelize_module`` of a converted model raised
"'ScalingState' object has no attribute 'weight'" (RowwiseParallel) or, at O1/O2, aborted the
process in gloo (the scatter of a master's empty wrapper storage); a DTensor input (sequence
parallelism) failed inside a cast op. On a 2-D mesh (FSDP2 over dp, tensor parallelism over tp)
every rank is refused alike, and the model with the tensor-parallel Linears left plain trains.

``dist.broadcast`` / ``all_reduce`` of an O1/O2 master or of an FP8 weight gradient (a hand-written
data-parallel loop) ran on a dequantized copy and dropped the result: the ranks' weights and
gradients stayed different, silently. Every in-place collective on fp8amp's
tensors is now refused, naming what works.

Pipeline parallelism (``torch.distributed.pipelining``: GPipe, 1F1B, and interleaved zero bubble with
two stages a rank, whose backward runs dX and dW apart; 4 micro-batches) of a converted model at
fp8 / O1 / O2, one optimizer a rank, with the amax reduction turned off (stages hold different
layers): every parameter and scaling buffer after every step is bit for bit
the one-process run's (the micro-batch loop with the gradients divided as the schedule divides
them), so the amaxes of all micro-batches are recorded and the scaling updates once a step. With
the default reduction over the world group, stages of the same shapes MAX-reduced the amaxes of
different layers together (stage 1's inputs took stage 0's amaxes), silently; the layer names are
now part of the ranks' layout check, so that is a ValueError naming set_amax_reduction. The
stages' DCP checkpoint (O2 model and optimizer) loads into the whole model in one process, which
goes on bit for bit as the run never split. The tracer split (``pipeline(model, ...)``), which
exports the model, and any export in training mode gave the weights no gradient, silently; refused.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from ranks import error_of, run_on_ranks

TIMEOUT = datetime.timedelta(seconds=30)
MICRO_BATCHES = 4
STEPS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def level(model: nn.Module, mode: str, **kwargs) -> nn.Module:
    if mode == "fp8":
        return fp8amp.convert(model, policy="all", **kwargs)
    return fp8amp.initialize(model, None, mode, policy="all", **kwargs)[0]


def not_tensor_parallel(module: nn.Module, fqn: str) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(module.weight, DTensor)


def tensor_parallel_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for mode in ("fp8", "O2"):
        out[f"tp_then_{mode}"] = error_of(lambda: level(parallelize_module(mlp(), mesh, tp_plan()), mode))
        for style in (ColwiseParallel, RowwiseParallel):
            model = level(mlp(), mode)
            out[f"{mode}_then_{style.__name__}"] = error_of(lambda: parallelize_module(model, mesh, {"2": style()}))
    # Sequence parallelism handing a converted Linear a DTensor.
    model = level(mlp(), "fp8")
    x = DTensor.from_local(torch.randn(16, 32), mesh, [Replicate()])
    out["dtensor_input"] = error_of(lambda: model(x))
    # What works: the tensor-parallel Linears stay nn.Linear, the others take FP8.
    model = level(parallelize_module(mlp(), mesh, tp_plan()), "O2", module_filter_fn=not_tensor_parallel)
    out["kept"] = [type(m).__name__ for m in model]
    y = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
    y.square().mean().backward()
    out["y"] = y.detach()
    # A hand-written data-parallel loop's all-reduce of an FP8 weight gradient: it stayed this rank's.
    out["grad_all_reduce"] = error_of(lambda: dist.all_reduce(model[4].weight.grad))
    # A master broadcast by hand: rank 1's weight stayed its own.
    torch.manual_seed(rank)
    master = fp8amp.initialize(nn.Sequential(nn.Linear(32, 32)), None, "O2", policy="all")[0][0].weight
    with torch.no_grad():
        out["broadcast"] = error_of(lambda: dist.broadcast(master, 0))
        out["all_reduce"] = error_of(lambda: dist.all_reduce(master))
    return out


def test_tensor_parallelism_is_refused_up_front_and_plain_tp_layers_work():
    results = run_on_ranks(tensor_parallel_rank, 2, timeout=TIMEOUT)
    model = level(mlp(), "O2", module_filter_fn=lambda m, fqn: fqn == "4")
    reference = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(1))).detach()
    for r in results:
        for mode in ("fp8", "O2"):
            assert r[f"tp_then_{mode}"].startswith("ValueError: fp8amp.convert: 0 is tensor-parallel"), r
            for style in ("ColwiseParallel", "RowwiseParallel"):
                error = r[f"{mode}_then_{style}"]
                assert error.startswith("NotImplementedError: Fp8Linear: tensor parallelism of fp8amp layers"), error
                assert "module_filter_fn" in error, error
        assert r["dtensor_input"].startswith("NotImplementedError: Fp8Linear: the input is a DTensor"), r
        assert r["kept"] == ["Linear", "GELU", "Linear", "GELU", "Fp8Linear"], r["kept"]
        # Bit for bit as one process here: the row-parallel layer sums in another order, which moves
        # its float32 sums by a last bit at most, and the FP8 layer's E4M3 cast absorbs that (an
        # element on a rounding boundary would move by one E4M3 step: not at these inputs).
        assert torch.equal(r["y"], reference), (r["y"] - reference).abs().max()
        for op in ("broadcast", "all_reduce", "grad_all_reduce"):
            assert r[op].startswith("NotImplementedError: fp8amp.ScaledTensor: torch.distributed collective"), r[op]
    assert torch.equal(results[0]["y"], results[1]["y"])


class Layered(nn.Module):
    """Blocks of the same shapes in a ModuleDict, as torch's pipelining examples split a model: a
    stage deletes the others' blocks and keeps its own blocks' names."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(32, 32), nn.GELU()) for i in range(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def stage_of(stage: int, stages: int = 2) -> nn.Module:
    model = Layered()
    per = len(model.layers) // stages
    for name in [name for i, name in enumerate(model.layers) if i // per != stage]:
        del model.layers[name]
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x, target = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    x[8:12] *= 50  # the third micro-batch has the largest amaxes
    return x, target


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def trained(model: nn.Module, mode: str):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "fp8":
        return fp8amp.convert(model, policy="all", optimizer=optimizer), optimizer
    return fp8amp.initialize(model, optimizer, mode, policy="all")


def state_of(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def micro_batch_step(model: nn.Module, optimizer, step: int) -> None:
    """One step of the micro-batch loop a pipeline schedule runs, in one process: the gradients
    summed over the micro-batches' losses and divided by their count (the schedules' scale_grads)."""
    for x, target in zip(*(t.chunk(MICRO_BATCHES) for t in batch(step))):
        loss_fn(model(x), target).backward()
    for p in model.parameters():
        p.grad.div_(MICRO_BATCHES)
    optimizer.step()
    optimizer.zero_grad()


def one_process(mode: str, steps: int = STEPS) -> list[dict]:
    model, optimizer = trained(Layered(), mode)
    states = []
    for step in range(steps):
        micro_batch_step(model, optimizer, step)
        states.append(state_of(model))
    return states


def dcp_state(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Flat optimizer keys (torchtitan's choice): each stage's param groups keep their own FQNs.
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model_state, "optimizer": optimizer_state}


def pipeline_rank(rank: int, runs: list, checkpoint: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

    out = {}
    # The default reduction over the world group: the stages' layers have the same shapes.
    model, optimizer = trained(stage_of(rank), "fp8")
    schedule = ScheduleGPipe(PipelineStage(model, rank, 2, torch.device("cpu")), MICRO_BATCHES, loss_fn=loss_fn)
    x, target = batch(0)
    schedule.step(x) if rank == 0 else schedule.step(target=target)
    out["world_reduction"] = error_of(optimizer.step)
    for mode, schedule_type in runs:
        # Interleaved zero bubble: stages 0 and 2 on rank 0, 1 and 3 on rank 1, one optimizer a rank.
        indices = [rank] if schedule_type != "zero_bubble" else [rank, rank + 2]
        stages = nn.ModuleList(stage_of(i, 4 if len(indices) > 1 else 2) for i in indices)
        stages, optimizer = trained(stages, mode)
        fp8amp.amax_sync.set_amax_reduction(stages, enabled=False)
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}
        pipe = [PipelineStage(m, i, 2 * len(indices), torch.device("cpu")) for m, i in zip(stages, indices)]
        schedule = schedule_class[schedule_type](pipe if len(pipe) > 1 else pipe[0], MICRO_BATCHES, loss_fn=loss_fn)
        states = []
        for step in range(STEPS):
            x, target = batch(step)
            schedule.step(x) if rank == 0 else schedule.step(target=target)
            optimizer.step()
            optimizer.zero_grad()
            states.append({k: v for m in stages for k, v in state_of(m).items()})
        out[mode, schedule_type] = states
        if (mode, schedule_type) == ("O2", "1f1b"):  # each stage saves its part of one checkpoint
            dcp.save(dcp_state(stages[0], optimizer), checkpoint_id=checkpoint)
    return out


def custom_function_nodes_have_input_metadata() -> bool:
    """Whether autograd gives a custom Function's node its input metadata, which a zero-bubble
    schedule's separate weight backward reads (``autograd.grad`` of a GradientEdge): torch 2.11
    raises "Attribute '_input_metadata' is invalid" there (pytorch issue 166577), for any
    autograd.Function, Fp8Linear's among them."""
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    try:
        Identity.apply(torch.zeros(1, requires_grad=True)).grad_fn._input_metadata
    except RuntimeError:
        return False
    return True


RUNS = [("fp8", "gpipe"), ("O1", "1f1b"), ("O2", "1f1b")]
if custom_function_nodes_have_input_metadata():
    RUNS.append(("O2", "zero_bubble"))


def test_pipeline_stages_train_bit_for_bit_as_one_process_and_resume_in_one(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    results = run_on_ranks(pipeline_rank, 2, RUNS, str(tmp_path), timeout=TIMEOUT)
    for r in results:
        error = r["world_reduction"]
        assert error.startswith("ValueError: fp8amp.update_scaling: the ranks of the amax-reduction group"), error
        assert "layer names" in error and "set_amax_reduction(model, process_group)" in error, error
    references = {mode: one_process(mode, STEPS + 1) for mode in {mode for mode, _ in RUNS}}
    for mode, schedule_type in RUNS:
        for step in range(STEPS):
            stages = {**results[0][mode, schedule_type][step], **results[1][mode, schedule_type][step]}
            assert stages.keys() == references[mode][step].keys()
            for key, value in references[mode][step].items():
                assert torch.equal(stages[key], value), (mode, schedule_type, step, key)
    # The stages' checkpoint (O2 model and optimizer) loads into the whole model in one process,
    # which goes on bit for bit as the run that was never split.
    model, optimizer = trained(Layered(), "O2")
    checkpoint = dcp_state(model, optimizer)
    dcp.load(checkpoint, checkpoint_id=str(tmp_path))
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
    micro_batch_step(model, optimizer, STEPS)
    for key, value in state_of(model).items():
        assert torch.equal(value, references["O2"][STEPS][key]), key


def test_pipeline_tracer_and_training_export_are_refused():
    """torch.distributed.pipelining.pipeline splits a model by tracing it with torch.export, which
    inlines Fp8Linear's autograd Function: the stages' backward ran through the FP8 ops, which have
    no derivative, and no weight got a gradient (torch warned only that it "may" be wrong). So did
    the module of any torch.export of a model in training mode."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    for mode in ("fp8", "O2"):
        model = level(Layered(), mode)
        x = torch.randn(4, 32)
        with pytest.raises(NotImplementedError, match=r"torch.export of a model in training mode .* no gradients.* "
                                                      r"eval\(\) .* PipelineStage"):
            torch.export.export(model, (x,))
        with pytest.raises(RuntimeError) as raised:
            pipeline(model, mb_args=(x,), split_spec={"layers.2": SplitPoint.BEGINNING})
        assert "Fp8Linear: torch.export of a model in training mode" in str(raised.value.__cause__)
        assert torch.equal(torch.export.export(model.eval(), (x,)).module()(x), model(x))


def two_d_rank(rank: int, mode: str) -> dict:
    """FSDP2 over dp, tensor parallelism over tp, as torchtitan composes them (the layers converted first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = level(mlp(), mode)
    out = {"refused": error_of(lambda: parallelize_module(model, mesh["tp"], tp_plan()))}
    # What works: the tensor-parallel Linears kept nn.Linear, FSDP2 over the whole model.
    model = parallelize_module(mlp(), mesh["tp"], tp_plan())
    model = level(model, mode, module_filter_fn=not_tensor_parallel)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes=mode)
    fp8amp.register_scaling_hooks(model, optimizer)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + dp_rank)
        model(torch.randn(8, 32, generator=gen) * (1 + 9 * dp_rank)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    out["buffers"] = {k: v.clone() for k, v in model.named_buffers()}
    return out


def test_fsdp2_and_tensor_parallelism_on_a_2d_mesh():
    results = run_on_ranks(two_d_rank, 4, "O2", timeout=TIMEOUT)
    for r in results:
        assert r["refused"].startswith("NotImplementedError: Fp8Linear: tensor parallelism"), r["refused"]
        assert r["buffers"].keys() == results[0]["buffers"].keys() and r["buffers"]
        for key, value in r["buffers"].items():  # the amaxes MAX-reduced over all 4 ranks
            assert torch.equal(value, results[0]["buffers"][key]), key
    assert results[0]["buffers"]["4.input_scaling.scale"] != 1  # the scales follow the amaxes
