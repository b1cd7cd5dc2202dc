"""torchtitan (the real package, 0.3) with fp8amp's converter, on the CPU (FP8 emulation): a llama3
debug model's config converted, built on the meta device, initialized as torchtitan's trainer does
(``to_empty``, ``init_weights``), trained with torchtitan's own optimizers container and the
scaling update of ``with_scaling_updates``; under FSDP2 on 2 gloo ranks with the FP8 all-gather."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fp8amp

pytest.importorskip("torchtitan")
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from fp8amp.fsdp import Fp8AllGatherWeight  # noqa: E402
from fp8amp.integrations.torchtitan import (  # noqa: E402
    Fp8ampLinear, Fp8ampLinearConverter, Fp8ampOptimizersContainer, Fp8ampScalingState, update_scaling_after_steps,
    with_scaling_updates)
from ranks import run_on_ranks  # noqa: E402

VOCAB = 2048  # the debug model's
STEPS = 6


def debug_spec(converter=None):
    """llama3's debug model (6 layers, width 256), with SDPA attention: FlexAttention has no
    backward on the CPU (the spec's config is changed in place; it is a new one each call)."""
    spec = model_registry("debugmodel", converters=None if converter is None else [converter])
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec


def build(spec, seed: int = 0, garbage_buffers: bool = False):
    """As torchtitan's trainer: build on meta, to_empty, init_weights."""
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    if garbage_buffers:  # what uninitialized memory may hold: init_weights must not depend on it
        for buffer in model.buffers():
            buffer.fill_(7)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def fp8amp_spec(**converter):
    return with_scaling_updates(debug_spec(Fp8ampLinearConverter.Config(**converter)))


def o2_states():
    return Fp8ampOptimizersContainer.config_from(default_adamw(lr=1e-3))


def with_optimizers(spec, optimizer=None, seed: int = 0):
    """The model and its optimizers container as torchtitan's trainer makes them: ``build``, the
    container (torch's AdamW unless ``optimizer``), then the spec's ``post_optimizer_build_fn``."""
    model = build(spec, seed)
    optimizers = (optimizer or default_adamw(lr=1e-3)).build(model_parts=[model])
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(optimizers, [model], None)
    return model, optimizers


def batch(seed: int = 0, rows: int = 2, seq: int = 32):
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizer, steps: int = STEPS, seed: int = 0) -> list[float]:
    x, y = batch(seed)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_converter_swaps_every_plain_linear_config_the_recipe_takes():
    spec = debug_spec(Fp8ampLinearConverter.Config(filter_fqns=["lm_head"]))
    kinds = {fqn: type(config) for fqn, config, _, _ in spec.model.traverse(Linear.Config)}
    assert len(kinds) == 31 and kinds["lm_head"] is Linear.Config  # 6 x (wqkv, wo, w1, w2, w3) + lm_head
    assert all(kind is Fp8ampLinear.Config for fqn, kind in kinds.items() if fqn != "lm_head")
    first = next(config for fqn, config, _, _ in spec.model.traverse(Linear.Config) if fqn != "lm_head")
    plain = next(config for fqn, config, _, _ in debug_spec().model.traverse(Linear.Config) if fqn != "lm_head")
    assert first.param_init is not None and first.param_init.keys() == plain.param_init.keys()
    assert first.recipe == "tensorwise" and first.fp8_all_gather is False


def test_converter_keeps_shapes_the_recipe_cannot_take_and_linear_subclasses():
    spec = debug_spec()
    configs = [(fqn, parent, attr) for fqn, _, parent, attr in spec.model.traverse(Linear.Config)]
    (fqn_a, parent_a, attr_a), (fqn_b, parent_b, attr_b) = configs[0], configs[1]
    odd = dataclasses.replace(_get(parent_a, attr_a), out_features=200)  # not a multiple of 128
    _set(parent_a, attr_a, odd)

    @dataclasses.dataclass(kw_only=True, slots=True)
    class OwnForward(Linear.Config):
        pass

    fields = {f.name: getattr(_get(parent_b, attr_b), f.name) for f in dataclasses.fields(Linear.Config)}
    _set(parent_b, attr_b, OwnForward(**fields))
    model_config = Fp8ampLinearConverter.Config(recipe="blockwise").build().convert(spec.model)
    kinds = {fqn: type(config) for fqn, config, _, _ in model_config.traverse(Linear.Config)}
    assert kinds[fqn_a] is Linear.Config and kinds[fqn_b] is OwnForward
    assert sum(kind is Fp8ampLinear.Config for kind in kinds.values()) == 29


def _get(parent, attr):
    return parent[attr] if isinstance(parent, list) else getattr(parent, attr)


def _set(parent, attr, value):
    if isinstance(parent, list):
        parent[attr] = value
    else:
        setattr(parent, attr, value)


def test_built_model_passes_torchtitans_module_check_with_torchtitans_initialization():
    model = build(debug_spec(Fp8ampLinearConverter.Config()), garbage_buffers=True)
    model.verify_module_protocol()  # raises on any submodule that is not a torchtitan Module
    layers = [m for m in model.modules() if isinstance(m, Fp8ampLinear)]
    assert len(layers) == 31
    states = [m for m in model.modules() if isinstance(m, fp8amp.ScalingState)]
    assert len(states) == 93 and all(isinstance(s, Fp8ampScalingState) for s in states)
    for state in states:  # every buffer back to its initial value after to_empty's garbage
        assert torch.equal(state.scale, torch.ones(1)) and torch.equal(state.scale_inv, torch.ones(1))
        assert not state.amax_history.any() and not state.counter.any() and not state._always_current.any()
    # torchtitan's param_init, in the same order: the same weights as the unconverted model's
    plain = build(debug_spec())
    ours = dict(model.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(ours[name], param), name


def test_trains_with_torchtitans_optimizers_container_and_updates_scaling_once_a_step():
    spec = fp8amp_spec()
    assert with_scaling_updates(spec) is spec  # a second call adds no second update
    model, optimizers = with_optimizers(spec)
    losses = train(model, optimizers)
    plain_losses = train(*with_optimizers(debug_spec()))
    assert losses[-1] < 0.5 * losses[0], losses
    for ours, reference in zip(losses, plain_losses):  # FP8's rounding, not another trajectory
        assert abs(ours - reference) < 0.05 * reference, (losses, plain_losses)
    wqkv = model.layers["0"].attention.qkv_linear.wqkv
    assert isinstance(wqkv, Fp8ampLinear)
    assert int(wqkv.input_scaling.counter) == STEPS and int(wqkv.grad_output_scaling.counter) == STEPS
    assert float(wqkv.input_scaling.amax_history[0, 1]) > 0  # the last step's amax, rolled once


def test_blocks_compiled_as_torchtitan_compiles_them_train_as_eager():
    spec = fp8amp_spec()
    spec.model.layers = spec.model.layers[:2]
    losses = {}
    for compiled in (False, True):
        model, optimizers = with_optimizers(spec)
        if compiled:  # torchtitan's apply_compile: each block, fullgraph (a graph break raises)
            for block in model.layers.values():
                block.compile(fullgraph=True)
        losses[compiled] = train(model, optimizers, steps=3)
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_state_dict_resumes_bit_for_bit():
    spec = fp8amp_spec()
    model, optimizers = with_optimizers(spec)
    train(model, optimizers, steps=3)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("input_scaling.amax_history") for k in saved)
    resumed = build(spec, seed=1)
    resumed.load_state_dict(saved, strict=True)
    x, _ = batch(1)
    with torch.no_grad():
        assert torch.equal(model(x), resumed(x))


def test_o2_optimizer_states_in_torchtitans_container_train_and_resume_through_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    spec = fp8amp_spec()
    model, optimizers = with_optimizers(spec, o2_states())
    assert [type(o) for o in optimizers] == [fp8amp.optim.AdamW]
    losses = train(model, optimizers, steps=4)
    state = optimizers.optimizers[0].state[model.layers["0"].feed_forward.w1.weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.float16
    for ours, reference in zip(losses, train(*with_optimizers(spec), steps=4)):  # float32 states
        assert abs(ours - reference) < 0.02 * reference, losses
    # torchtitan's checkpointer: DCP over the model's state dict and the container (a Stateful)
    dcp.save({"model": model.state_dict(), "optimizer": optimizers}, checkpoint_id=str(tmp_path))
    resumed, resumed_optimizers = with_optimizers(spec, o2_states(), seed=1)
    model_state = resumed.state_dict()
    dcp.load({"model": model_state, "optimizer": resumed_optimizers}, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(model_state)
    assert train(resumed, resumed_optimizers, steps=3, seed=5) == train(model, optimizers, steps=3, seed=5)


def test_unconvert_gives_the_state_dict_of_a_model_built_without_the_converter_and_its_hf_export():
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    spec = fp8amp_spec()
    model, optimizers = with_optimizers(spec)
    train(model, optimizers, steps=2)
    x, _ = batch(1)
    with torch.no_grad():
        fp8_logits = model(x)
    fp8amp.unconvert(model)
    plain = build(debug_spec(), seed=1)
    plain.load_state_dict(model.state_dict(), strict=True)  # no scaling keys left, none missing
    with torch.no_grad():
        logits = plain(x)
        assert torch.equal(logits, model(x))
    assert F.cosine_similarity(logits.flatten(), fp8_logits.flatten(), dim=0) > 0.99  # FP8 vs high precision
    hf = Llama3StateDictAdapter(spec.model, None).to_hf(plain.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in hf and not any("scaling" in k for k in hf)


def test_bad_configs_are_refused_with_the_accepted_values():
    with pytest.raises(ValueError, match="recipe must be one of 'tensorwise'.*got 'fp4'"):
        Fp8ampLinearConverter.Config(recipe="fp4").build()
    with pytest.raises(TypeError, match="recipe must be a name, one of 'tensorwise'"):
        Fp8ampLinearConverter.Config(recipe=fp8amp.Recipe("blockwise")).build()
    with pytest.raises(ValueError, match="fp8_all_gather is for recipe='tensorwise'"):
        Fp8ampLinearConverter.Config(recipe="blockwise", fp8_all_gather=True).build()
    with pytest.raises(TypeError, match="filter_fqns must be a list of str"):
        Fp8ampLinearConverter.Config(filter_fqns="lm_head").build()
    with pytest.raises(TypeError, match="model_spec must be a torchtitan ModelSpec"):
        with_scaling_updates(debug_spec().model)
    model = build(debug_spec())
    with pytest.raises(ValueError, match="state_dtypes must be one of 'O1', 'O2'; got 'O3'"):
        Fp8ampOptimizersContainer.config_from(default_adamw(), state_dtypes="O3").build(model_parts=[model])
    bf16_states = Fp8ampOptimizersContainer.config_from(default_adamw())
    bf16_states.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match="which state_dtypes decides here"):
        bf16_states.build(model_parts=[model])
    with pytest.raises(TypeError, match="config must be an OptimizersContainer.Config"):
        Fp8ampOptimizersContainer.config_from({"lr": 1e-3})


def test_tensor_parallelism_is_refused_before_the_first_step():
    from torchtitan.distributed import ParallelDims

    model = build(debug_spec(Fp8ampLinearConverter.Config()))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    with pytest.raises(NotImplementedError, match="tensor parallelism is not supported"):
        update_scaling_after_steps(optimizers, [model], parallel_dims)


def fsdp_rank(rank: int, fp8_all_gather: bool, o2: bool = False) -> dict:
    """The debug model (2 layers) sharded as torchtitan does: fully_shard each block, then the
    model, on the meta device; then to_empty and init_weights; trained on each rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    spec = fp8amp_spec(fp8_all_gather=fp8_all_gather)
    spec.model.layers = spec.model.layers[:2]
    with torch.device("meta"):
        model = spec.model.build()
    mesh = init_device_mesh("cpu", (2,))  # (torchtitan's ParallelDims makes CUDA meshes only)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    wrapped = isinstance(model.layers["0"].feed_forward.w1.weight.to_local(), Fp8AllGatherWeight)
    optimizers = (o2_states() if o2 else default_adamw(lr=1e-3)).build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], None)  # no ParallelDims: the default group
    losses = train(model, optimizers, steps=3, seed=rank)
    scales = [s.scale.clone() for s in model.modules() if isinstance(s, fp8amp.ScalingState)]
    full = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for k, v in model.state_dict().items()}
    moments = optimizers.optimizers[0].state[model.layers["0"].feed_forward.w1.weight]
    return {"wrapped": wrapped, "losses": losses, "scales": scales, "state": full,
            "moment_dtypes": [moments["exp_avg"].dtype, moments["exp_avg_sq"].dtype]}


def test_fsdp2_with_fp8_all_gather_trains_bit_for_bit_as_without_and_ranks_agree():
    fp8 = run_on_ranks(fsdp_rank, 2, True)
    plain = run_on_ranks(fsdp_rank, 2, False)
    assert [r["wrapped"] for r in fp8] == [True, True] and [r["wrapped"] for r in plain] == [False, False]
    for ours, reference in zip(fp8, plain):
        assert ours["losses"] == reference["losses"]
        assert ours["state"].keys() == reference["state"].keys()
        for key, value in ours["state"].items():
            assert torch.equal(value, reference["state"][key]), key
    # the amaxes are MAX-reduced over the ranks: one set of scales
    for a, b in zip(fp8[0]["scales"], fp8[1]["scales"]):
        assert torch.equal(a, b)
    assert fp8[0]["losses"] != fp8[1]["losses"]  # different batches: the agreement is the reduction's


def test_fsdp2_with_o2_optimizer_states_trains_the_shards_as_one_model():
    ranks = run_on_ranks(fsdp_rank, 2, True, True)
    assert [r["moment_dtypes"] for r in ranks] == [[torch.float8_e4m3fn, torch.float16]] * 2  # on the shards
    buffers = [key for key in ranks[0]["state"] if "_scaling." in key]  # each rank's own copy
    assert len(buffers) == 11 * 3 * 4  # (2 blocks x 5 Linears + lm_head) x 3 states x 4 buffers
    for key in buffers:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
    assert all(r["losses"][-1] < r["losses"][0] for r in ranks), [r["losses"] for r in ranks]


def parallelize_rank(rank: int, fp8_all_gather: bool, dp_shard: int = 1, dp_replicate: int = 1) -> dict:
    """llama3's own parallelize_llama (its default spmd_types backend, FSDP2 with bfloat16
    parameters) on ``dp_shard * dp_replicate`` gloo ranks, the converted model against the
    unconverted one, each rank training on its own batch. As torchtitan's trainer: the SPMD backend
    set, the sharding configs that its ``update_from_config`` sets (each Linear's weight a DTensor
    of the whole mesh before ``fully_shard``), and the optimizers container's hook given the
    ``ParallelDims``. ParallelDims makes its meshes on "cuda" when no accelerator is found: pointed
    at the CPU here; and FSDP2's gradient division (a PREMUL_SUM under torchtitan's divide factor
    of 1) made a plain SUM, which gloo has."""
    import warnings

    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallel_dims_module.device_type = "cpu"
    set_spmd_backend(ParallelismConfig().spmd_backend)
    # one for both models: the SPMD types know the meshes it made first by identity
    parallel_dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=1, pp=1, ep=1,
                                 world_size=dp_shard * dp_replicate)
    out = {}
    for name, spec in (("plain", debug_spec()), ("fp8amp", fp8amp_spec(fp8_all_gather=fp8_all_gather))):
        spec.model.layers = spec.model.layers[:2]
        set_llama3_sharding_config(spec.model, enable_sp=False)
        with torch.device("meta"):
            model = spec.model.build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = parallelize_llama(model, parallel_dims=parallel_dims, training=TrainingConfig(),
                                      parallelism=ParallelismConfig(), compile_config=CompileConfig(), ac_config=None,
                                      dump_folder="")
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            model.verify_module_protocol()
            optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
            if spec.post_optimizer_build_fn is not None:
                spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
            out[name] = train(model, optimizers, steps=3, seed=rank)
        out[name, "view warnings"] = sum("returned a view" in str(w.message) for w in caught)
    weight = model.layers["0"].feed_forward.w1.weight
    out["fp8 all-gather"] = isinstance(weight.to_local() if hasattr(weight, "to_local") else weight, Fp8AllGatherWeight)
    out["scales"] = [s.scale.clone() for s in model.modules() if isinstance(s, fp8amp.ScalingState)]
    return out


@pytest.mark.parametrize("fp8_all_gather", [False, True], ids=["bf16-all-gather", "fp8-all-gather"])
def test_torchtitans_parallelize_llama_trains_the_converted_model(fp8_all_gather):
    (out,) = run_on_ranks(parallelize_rank, 1, fp8_all_gather)
    for ours, reference in zip(out["fp8amp"], out["plain"]):
        assert abs(ours - reference) < 0.05 * reference, out
    assert out["fp8amp", "view warnings"] == 0  # FSDP2 warns of a module returning a view
    assert out["fp8 all-gather"] == fp8_all_gather


@pytest.mark.parametrize("dp_shard, dp_replicate", [(2, 1), (1, 2)], ids=["fsdp", "replicate"])
def test_parallelize_llama_on_two_data_parallel_ranks_reduces_the_amaxes_over_the_loss_mesh(dp_shard, dp_replicate):
    ranks = run_on_ranks(parallelize_rank, 2, True, dp_shard, dp_replicate)
    for out in ranks:
        for ours, reference in zip(out["fp8amp"], out["plain"]):
            assert abs(ours - reference) < 0.05 * reference, out
        assert out["fp8 all-gather"]  # also where the shard group is one rank: FSDP2 wraps every weight
    assert ranks[0]["fp8amp"] != ranks[1]["fp8amp"]  # each rank's batch: the agreement is the reduction's
    assert len(ranks[0]["scales"]) == 11 * 3  # (2 blocks x 5 Linears + output) x 3 scaling states
    for a, b in zip(ranks[0]["scales"], ranks[1]["scales"]):
        assert torch.equal(a, b)
