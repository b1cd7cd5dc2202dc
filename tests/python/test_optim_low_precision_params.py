"""fp8amp's Adam/AdamW on bfloat16/float16 params (a model loaded in bf16): each step in float32,
rounded back into the param once; checked against torch's AdamW on the same params."""

import pytest
import torch
from torch import nn

import fp8amp


def _grads(shapes, steps, dtype):
    gen = torch.Generator().manual_seed(3)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_is_torch_adamw_in_float32_rounded_once(dtype):
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5)]
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    reference = [nn.Parameter(p.detach().float()) for p in params]
    ours = fp8amp.optim.AdamW(params, lr=1e-2, weight_decay=0.1, state_dtypes="O1")
    theirs = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    for grads in _grads(shapes, 5, dtype):
        for p, r, g in zip(params, reference, grads):
            p.grad, r.grad = g, g.float()
        ours.step()
        theirs.step()
        with torch.no_grad():
            for r in reference:  # the param holds only its low-precision rounding between steps
                r.copy_(r.to(dtype).float())
    for p, r in zip(params, reference):
        assert p.dtype == dtype
        # m and v are torch's bit for bit (same grads, same float32 math); the update agrees to
        # ~2^-21 relative, so the one rounding into the param differs at most by one ulp, rarely.
        assert torch.equal(ours.state[p]["exp_avg"], theirs.state[r]["exp_avg"])
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"])
        expected = r.detach().to(dtype)
        ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((p.detach().float() - expected.float()).abs() <= ulp).all()
        assert (p.detach() == expected).float().mean() > 0.97


def test_close_to_torch_adamw_stepping_the_same_bf16_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 16)).to(torch.bfloat16)
    twin = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 16)).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    ours = fp8amp.optim.AdamW(model.parameters(), lr=1e-3)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in model.parameters()]
    shapes = [p.shape for p in model.parameters()]
    for grads in _grads(shapes, 5, torch.bfloat16):
        for p, q, g in zip(model.parameters(), twin.parameters(), grads):
            p.grad, q.grad = g, g.clone()
        ours.step()
        theirs.step()
    for p, q, p0 in zip(model.parameters(), twin.parameters(), start):
        # (an update below half an ulp is lost in bf16, by both: the LayerNorm weight of ones stays)
        moved = (p.detach().float() - p0.float()).abs()
        # torch rounds m, v and each of its ops to bf16, fp8amp only the new param: an element may
        # end up to about one step's update (lr) apart, but on average far less than the params moved.
        apart = (p.detach().float() - q.detach().float()).abs()
        assert (apart <= 1.5e-3 + 2 * torch.finfo(torch.bfloat16).eps * q.detach().float().abs()).all()
        assert apart.mean() <= 0.1 * moved.mean()
    assert moved.mean() > 1e-3  # the last Linear's bias moved: the test compares steps that happened


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_model_trains_at_every_level(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32)).to(torch.bfloat16)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), level, policy="all")
    assert model[2].weight.dtype == torch.bfloat16 and type(model[2].weight.data) is torch.Tensor
    x = torch.randn(64, 32).to(torch.bfloat16)
    target = torch.randn(64, 32).to(torch.bfloat16)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - target.float()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_16_bit_model_resumes_from_its_state_dicts_bit_for_bit(level, dtype):
    """Saved and loaded through torch.save, a bf16/fp16 model's masters (float32 in the state dict:
    the FP16 master's scaled values do not all fit its logical dtype) and its optimizer's moments
    (torch's load casts states to a 16-bit param's dtype; fp8amp takes them as saved) resume bit
    for bit: both used to round, and the resumed run drifted."""
    import io

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)).to(dtype)
        return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, policy="all")

    def train(model, opt, steps):
        for t in steps:
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(t)).to(dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(3))
    assert model.state_dict()["0.weight"].dtype == torch.float32
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, range(3, 6))
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed, resumed_opt = build()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, range(3, 6))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), resumed.parameters()):
        for key, value in opt.state[p].items():
            other = resumed_opt.state[q][key]
            assert value.dtype == other.dtype and torch.equal(value.float(), other.float()), key


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_torch_adamw_state_of_a_bf16_model_loads_at_every_level(level):
    """torch's AdamW keeps a bf16 param's moments in bf16: loaded, they become the level's formats
    (O2's scaled ones too: they stayed bf16, and the first step raised)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)).to(torch.bfloat16)

    plain = model()
    opt = torch.optim.AdamW(plain.parameters())
    plain(torch.randn(4, 32).bfloat16()).float().square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    converted = model()
    converted, fp8_opt = fp8amp.initialize(converted, torch.optim.AdamW(converted.parameters()), level, policy="all")
    fp8_opt.load_state_dict(saved)
    m_dtype, v_dtype = fp8amp.optim.STATE_DTYPES[level]
    for i, p in enumerate(converted.parameters()):
        state = fp8_opt.state[p]
        assert state["exp_avg"].dtype == m_dtype and state["exp_avg_sq"].dtype == v_dtype
        real = state["exp_avg_sq"].float() * state.get("exp_avg_sq_scale_inv", 1.0)
        torch.testing.assert_close(real, saved["state"][i]["exp_avg_sq"].float(), rtol=2 ** -8, atol=0)
    converted(torch.randn(4, 32).bfloat16()).float().square().mean().backward()
    fp8_opt.step()


def test_other_param_dtypes_are_refused_naming_the_accepted():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fp8amp.optim.AdamW([nn.Parameter(torch.zeros(4, dtype=torch.float64))])
