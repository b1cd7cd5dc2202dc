"""``master_rounding="stochastic"`` of fp8amp's Adam/AdamW (docs/numerics.md#stochastic-rounding):
its options and their errors, the random stream (seeds, groups, steps; a run repeats bit for bit,
also through a checkpoint), torch.compile, the Lightning plugin's option, FSDP2 shards and DDP
replicas (2 gloo processes), and (GPU-marked) CUDA against CPU bit for bit. What it does to training is measured in test_small_updates_usage.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from ranks import run_on_ranks


def model(seed=0, width=48):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 16))


def batches(n, width=48):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, width, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(n)]


def o2(net, lr=1e-3, **options):
    return fp8amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=lr), "O2", policy="all", **options)


def codes(net):
    return [p.codes.clone() for p in net.parameters() if isinstance(p, fp8amp.ScaledTensor)]


def train(net, opt, data):
    for x, y in data:
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_options_are_checked_and_name_what_is_accepted():
    params = model()[0].parameters()
    with pytest.raises(ValueError, match=r"master_rounding must be one of 'nearest', 'stochastic'; got 'up'"):
        fp8amp.optim.AdamW(params, master_rounding="up")
    for seed in ("1", True, 2**64, -2**63 - 1, 1.5):
        with pytest.raises(ValueError, match=r"rounding_seed must be an int"):
            fp8amp.optim.AdamW(model()[0].parameters(), master_rounding="stochastic", rounding_seed=seed)
    # a group edited mid-run is checked at the step that reads it
    net, opt = o2(model(), master_rounding="stochastic")
    train(net, opt, batches(1))
    opt.param_groups[0]["master_rounding"] = "Stochastic"
    with pytest.raises(ValueError, match=r"fp8amp.optim.AdamW: master_rounding must be one of"):
        train(net, opt, batches(1))
    # initialize: refused before the model changes; without an optimizer, it names where it goes
    net = model()
    with pytest.raises(ValueError, match=r"initialize: fp8amp.optim.AdamW: master_rounding must be one of"):
        o2(net, master_rounding="sr")
    assert type(net[0]) is nn.Linear
    with pytest.raises(ValueError, match=r"initialize: master_rounding is an option of the optimizer.*"
                                         r"fp8amp.initialize_optimizer\(model, optimizer, 'O2', "
                                         r"master_rounding='stochastic'\)"):
        fp8amp.initialize(net, None, "O2", master_rounding="stochastic")
    assert type(net[0]) is nn.Linear
    # the op: a bool and an int64
    p = torch.zeros(4)
    with pytest.raises(TypeError, match=r"stochastic_rounding.*a bool"):
        fp8amp.ops.adam_step([p], [p.clone()], [p.clone()], [p.clone()], lr=1e-3, step=1, stochastic_rounding=1)
    with pytest.raises(ValueError, match=r"rounding_seed must be an int64"):
        fp8amp.ops.adam_step([p], [p.clone()], [p.clone()], [p.clone()], lr=1e-3, step=1, rounding_seed=2**63)


def test_the_default_is_round_to_nearest_and_stochastic_rounding_changes_only_masters():
    """Nearest (default) is what the optimizer always did: the same codes as master_rounding="nearest"
    given; stochastic rounding changes the masters' codes by at most one FP16 unit a step, and
    leaves the other params (biases: float32) as nearest leaves them after one step."""
    data = batches(1)
    runs = {}
    for rounding in (None, "nearest", "stochastic"):
        net, opt = o2(model(), **({} if rounding is None else {"master_rounding": rounding}))
        before = codes(net)
        train(net, opt, data)
        runs[rounding] = (net, before)
    (default, before), (nearest, _), (stochastic, _) = runs[None], runs["nearest"], runs["stochastic"]
    assert all(torch.equal(a, b) for a, b in zip(codes(default), codes(nearest)))
    assert not all(torch.equal(a, b) for a, b in zip(codes(default), codes(stochastic)))
    for a, b in zip(codes(default), codes(stochastic)):
        assert (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max() <= 1
    assert torch.equal(default[0].bias, stochastic[0].bias)


def test_a_run_repeats_and_seeds_groups_and_steps_draw_different_bits():
    """Two runs with one seed are bit-identical; another seed rounds differently. Two equal layers
    in two groups (or two equal layers in one group) with equal grads round apart: the op's streams
    differ by the group and by the param's place."""
    data = batches(3)

    def run(seed, groups):
        torch.manual_seed(0)
        twin = nn.Linear(48, 48)
        net = nn.Sequential(twin, copy.deepcopy(twin))
        params = ([{"params": net[0].parameters()}, {"params": net[1].parameters()}] if groups
                  else net.parameters())
        net, opt = fp8amp.initialize(net, torch.optim.AdamW(params, lr=1e-4), "O2", policy="all",
                                     master_rounding="stochastic")
        opt.param_groups[0]["rounding_seed"] = opt.param_groups[-1]["rounding_seed"] = seed
        for x, _ in data:  # the same input into both layers: equal grads
            (net[0](x).square().sum() + net[1](x).square().sum()).backward()
            opt.step()
            opt.zero_grad()
        return codes(net)

    for groups in (False, True):
        first = run(5, groups)
        assert all(torch.equal(a, b) for a, b in zip(first, run(5, groups)))
        assert not torch.equal(first[0], first[1]), groups
        assert not torch.equal(first[0], run(6, groups)[0])


def test_the_rounding_and_its_seed_resume_bit_for_bit_through_a_state_dict():
    """The seed is a group option (saved with the state dict); the step number comes from the
    state: a resumed run draws the bits the uninterrupted one drew. A state dict saved before the
    rounding options existed loads with the optimizer's own."""
    data = batches(6)
    net, opt = o2(model(), master_rounding="stochastic", lr=1e-4)
    opt.param_groups[0]["rounding_seed"] = 1234
    train(net, opt, data[:3])
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    assert saved[1]["param_groups"][0]["rounding_seed"] == 1234
    train(net, opt, data[3:])

    resumed, resumed_opt = o2(model(seed=1), master_rounding="stochastic", lr=1e-4)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert resumed_opt.param_groups[0]["rounding_seed"] == 1234
    train(resumed, resumed_opt, data[3:])
    assert all(torch.equal(a, b) for a, b in zip(codes(net), codes(resumed)))

    older = copy.deepcopy(saved[1])
    for group in older["param_groups"]:
        del group["master_rounding"], group["rounding_seed"]
    again, again_opt = o2(model(seed=1), master_rounding="stochastic", lr=1e-4)
    own_seed = again_opt.param_groups[0]["rounding_seed"]
    again.load_state_dict(saved[0])
    again_opt.load_state_dict(older)
    assert again_opt.param_groups[0]["master_rounding"] == "stochastic"
    assert again_opt.param_groups[0]["rounding_seed"] == own_seed


@pytest.mark.filterwarnings("ignore:initialize. 2 Linear master")  # (nearest's warning: its own test)
def test_a_compiled_step_rounds_stochastically_and_repeats():
    """Under torch.compile the step's op calls take the rounding options as constants; the compiled
    run keeps small updates (nearest would lose them) and repeats bit for bit."""
    data = batches(4)

    def run(rounding):
        net, opt = o2(model(width=32), lr=2e-6, master_rounding=rounding)
        step = torch.compile(opt.step, backend="aot_eager")
        before = codes(net)
        for x, y in data:
            F.mse_loss(net(x[:, :32]), y).backward()
            step()
            opt.zero_grad()
        return before, codes(net)

    before, nearest = run("nearest")
    _, stochastic = run("stochastic")
    moved = lambda after: sum((a != b).sum().item() for a, b in zip(before, after))  # noqa: E731
    assert moved(stochastic) > 2 * moved(nearest)
    assert all(torch.equal(a, b) for a, b in zip(stochastic, run("stochastic")[1]))


def test_the_lightning_plugins_pass_master_rounding_to_the_optimizer():
    L = pytest.importorskip("lightning")
    from fp8amp.integrations.lightning import Fp8ampFabricPrecision, Fp8ampPrecision

    with pytest.raises(ValueError, match=r"Fp8ampPrecision: master_rounding must be one of"):
        Fp8ampPrecision("O2", master_rounding="up")
    precision = Fp8ampFabricPrecision("O2", autocast_dtype=None, master_rounding="stochastic")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = fabric.setup_module(model())
    optimizer = fabric.setup_optimizers(precision.convert_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3)))
    assert [g["master_rounding"] for g in optimizer.param_groups] == ["stochastic"]
    for x, y in batches(2):
        fabric.backward(F.mse_loss(net(x), y))
        optimizer.step()
        optimizer.zero_grad()


def test_optimizers_built_one_per_parameter_draw_apart():
    """initialize_optimizer gives a torch optimizer's groups seeds from their first param's name in
    the model: two equal layers, each with its own optimizer (optimizer in backward), round apart
    (with one seed for both, each numbering its param 0, they drew the same bits), the same in
    every run; an explicit seed in a group, or an fp8amp optimizer's, is kept."""
    def run():
        torch.manual_seed(0)
        twin = nn.Linear(48, 48, bias=False)
        net, _ = fp8amp.initialize(nn.Sequential(twin, copy.deepcopy(twin)), None, "O2", policy="all")
        opts = [fp8amp.initialize_optimizer(net, torch.optim.AdamW([p], lr=1e-4), "O2", master_rounding="stochastic")
                for p in net.parameters()]
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(0))
        (net[0](x).square().sum() + net[1](x).square().sum()).backward()
        for opt in opts:
            opt.step()
        return codes(net), [opt.param_groups[0]["rounding_seed"] for opt in opts]

    (first, second), seeds = run()
    assert seeds[0] != seeds[1] and not torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(run()[0], (first, second)))
    net = model()
    _, kept = fp8amp.initialize(net, torch.optim.AdamW([{"params": net.parameters(), "rounding_seed": 5}]), "O2",
                                policy="all", master_rounding="stochastic")
    assert kept.param_groups[0]["rounding_seed"] == 5


def twin_rows_rank(rank: int, how: str) -> list[torch.Tensor]:
    """A 64 x 32 O2 master whose rows 32-63 equal rows 0-31 (so their gradients are equal too),
    stepped with stochastic rounding under ``fully_shard`` (rank r holds rows 32r to 32r + 31) or
    DDP; returns this rank's codes of it after each step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        layer.weight[32:] = layer.weight[:32]
    net, _ = fp8amp.initialize(nn.Sequential(layer), None, "O2", policy="all")
    if how == "fsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        net = nn.parallel.DistributedDataParallel(net)
    opt = fp8amp.optim.AdamW(net.parameters(), lr=3e-5, weight_decay=0.0, state_dtypes="O2",
                             master_rounding="stochastic")
    weight = net.module[0].weight if how == "ddp" else net[0].weight
    out = []
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))  # the same batch on both ranks
        net(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        local = weight.to_local() if how == "fsdp" else weight
        out.append(local.codes.clone())
    return out


@pytest.mark.parametrize("how", ["fsdp", "ddp"])
def test_shards_draw_their_own_bits_and_replicas_the_same(how):
    """FSDP2: two shards holding equal values with equal gradients round apart (the op numbers a
    shard's elements from 0, so without the shard's place in the seed they drew the same bits).
    DDP: the ranks' masters stay bit-identical (equal bits for the replicas)."""
    ranks = run_on_ranks(twin_rows_rank, 2, how)
    for step, (a, b) in enumerate(zip(*ranks)):
        if how == "ddp":
            assert torch.equal(a, b), step
        else:
            assert a.shape == b.shape == (32, 32)
            assert not torch.equal(a, b), step


@pytest.mark.gpu
def test_cuda_rounds_as_the_cpu_bit_for_bit():
    """The same model, grads and seed on both devices: every master code, scale and moment equal
    after three steps (the CUDA kernels draw the CPU reference's bits)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    nets = {}
    for device in ("cpu", "cuda"):
        net = model(width=384).to(device)
        nets[device] = o2(net, lr=1e-5, master_rounding="stochastic")
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        grads = {name: torch.randn(p.shape, generator=gen) * 1e-2 for name, p in nets["cpu"][0].named_parameters()}
        for device, (net, opt) in nets.items():
            for name, p in net.named_parameters():
                p.grad = (fp8amp.ScaledTensor.from_tensor(grads[name].to(device), torch.float8_e4m3fn)
                          if isinstance(p, fp8amp.ScaledTensor) else grads[name].to(device))
            opt.step()
    (cpu, cpu_opt), (cuda, cuda_opt) = nets["cpu"], nets["cuda"]
    for a, b in zip(codes(cpu), codes(cuda)):
        assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16))
    for p, q in zip(cpu.parameters(), cuda.parameters()):
        for key, value in cpu_opt.state[p].items():
            other = cuda_opt.state[q][key]
            other = other.dequantize() if hasattr(other, "dequantize") else other
            mine = value.dequantize() if hasattr(value, "dequantize") else value
            assert torch.equal(mine.float().cpu(), other.float().cpu()), key
