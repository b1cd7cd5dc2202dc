"""fp8amp's optimizers as users configure them: constructor options, param lists, and the hooks
torch's optimizers take, each compared with ``torch.optim.AdamW`` on the unconverted model."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ["O1", "O2"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def _train(model, optimizer, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _initialized(level):
    model = _model()
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)


def _moment(state, key):
    """A live moment's real values: at O2, codes with a scale_inv beside them."""
    scale_inv = state.get(f"{key}_scale_inv")
    return state[key].float() if scale_inv is None else state[key].float() * scale_inv


@pytest.mark.parametrize("how", ["constructor", "add_param_group", "initialize"])
def test_a_param_listed_twice_in_a_group_is_refused_where_the_group_is_made(how):
    """torch warns about a duplicate param (and would step it twice a step); fp8amp's step failed
    at its first call with an error about the fused op's internal lists ("fp8amp.adam_step:
    params[0] and params[6] must not share memory"), naming nothing the user wrote."""
    model = _model()
    params = list(model.parameters())
    which = "param 2 of group 1" if how == "add_param_group" else "param 6 of group 0"
    with pytest.raises(ValueError, match=f"{which} is param 0 of the same group"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own warning about the duplicate)
        if how == "constructor":
            fp8amp.optim.AdamW(params + [params[0]], state_dtypes="O2")
        elif how == "add_param_group":
            optimizer = fp8amp.optim.AdamW(params[2:], state_dtypes="O2")
            optimizer.add_param_group({"params": params[:2] + [params[0]]})
        else:
            fp8amp.initialize(model, torch.optim.AdamW(params + [params[0]]), "O2")
    if how == "add_param_group":
        assert len(optimizer.param_groups) == 1
    if how == "initialize":  # refused before the model changed
        assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("level", LEVELS)
def test_load_state_dict_post_hooks_see_and_keep_the_loaded_state(level):
    """A load_state_dict post hook ran inside torch's load, before fp8amp had restored the state's
    formats: at O2 it read exp_avg as float32 copies of the E4M3 codes (values of ~300 for moments
    of ~1e-3), and what it wrote into the moments (a momentum reset on resume) was overwritten."""
    model, optimizer = _initialized(level)
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    expected = {key: _moment(optimizer.state[model[0].weight], key) for key in ("exp_avg", "exp_avg_sq")}
    seen = {}

    def read(opt):
        state = opt.state[model[0].weight]
        seen.update({key: (state[key].dtype, _moment(state, key)) for key in expected})

    handle = optimizer.register_load_state_dict_post_hook(read)
    optimizer.load_state_dict(saved)
    handle.remove()
    for key, (dtype, value) in seen.items():
        assert dtype == optimizer.state[model[0].weight][key].dtype
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)

    def reset(opt):
        for state in opt.state.values():
            state["exp_avg"].zero_()

    optimizer.register_load_state_dict_post_hook(reset)
    optimizer.load_state_dict(saved)
    assert all(not state["exp_avg"].float().any() for state in optimizer.state.values())
    _train(model, optimizer, 1)  # and it steps from there


@pytest.mark.parametrize("level", LEVELS)
def test_load_state_dict_pre_hooks_see_the_saved_form_and_their_changes_load(level):
    """A pre hook got fp8amp's internal form (O2: bare E4M3 codes beside scale entries) rather
    than what state_dict() returned, and a moment it replaced by real values (float32 zeros) was
    loaded as if it were codes, or failed inside an op."""
    model, optimizer = _initialized(level)
    _train(model, optimizer, 2)
    saved = optimizer.state_dict()
    kinds = {}

    def adapt(opt, state_dict):
        kinds.update({key: type(value) for key, value in state_dict["state"][0].items()})
        state_dict = copy.deepcopy(state_dict)
        for state in state_dict["state"].values():
            state["exp_avg"] = torch.zeros(tuple(state["exp_avg"].shape))
        state_dict["param_groups"][0]["lr"] = 1e-4
        return state_dict

    optimizer.register_load_state_dict_pre_hook(adapt)
    optimizer.load_state_dict(saved)
    assert kinds == {key: type(value) for key, value in saved["state"][0].items()}
    assert optimizer.param_groups[0]["lr"] == 1e-4
    for state in optimizer.state.values():
        assert not state["exp_avg"].float().any()
        assert state["exp_avg"].dtype == fp8amp.optim.STATE_DTYPES[level][0]
    _train(model, optimizer, 1)


@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_post_hooks_see_what_state_dict_returns(level):
    """A state_dict post hook got the O2 moments as bare codes beside scale entries, which
    fp8amp then rewrote: a hook that logs or edits the moments saw another form than the caller."""
    model, optimizer = _initialized(level)
    _train(model, optimizer, 2)
    plain = optimizer.state_dict()
    seen = {}

    def post(opt, state_dict):
        seen.update({key: type(value) for key, value in state_dict["state"][0].items()})
        state_dict["extra"] = 1

    optimizer.register_state_dict_post_hook(post)
    hooked = optimizer.state_dict()
    assert seen == {key: type(value) for key, value in plain["state"][0].items()}
    assert hooked["extra"] == 1


@pytest.mark.parametrize("level", LEVELS)
def test_moments_replaced_by_hand_step_as_torch(level):
    """A user's reset of the moments (``state["exp_avg"] = torch.zeros_like(p)``, as with
    torch's AdamW) failed at O2 in the fused op ("fp8amp.adam_step: exp_avg_scales[0] must be
    None: its exp_avg is float32"): the new tensor holds real values, and the state still held
    the old moment's scales. It is now brought into the group's format at the next step."""
    model, plain = _model(), _model()
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes=level)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for m, opt in ((model, optimizer), (plain, reference)):
        _train(m, opt, 3)
        for p in m.parameters():
            opt.state[p]["exp_avg"] = torch.zeros_like(p)
            opt.state[p]["exp_avg_sq"] = torch.full_like(p, 1e-6)
        _train(m, opt, 3, seed=2)
    m_dtype, v_dtype = fp8amp.optim.STATE_DTYPES[level]
    for p, q in zip(model.parameters(), plain.parameters()):
        state = optimizer.state[p]
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, float(state["step"])) == (m_dtype, v_dtype, 6.0)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0.02 * float(q.detach().abs().max()))


@pytest.mark.parametrize("state_dtypes", ["O1", "O2"])
def test_params_made_channels_last_after_the_first_step_step_as_torch(state_dtypes):
    # The step's kept plan held the conv weights as contiguous: after
    # model.to(memory_format=torch.channels_last) the next step was refused ("params[0] must be
    # contiguous"). Such params step through a contiguous copy from then on, as torch's AdamW.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.Conv2d(8, 4, 3))
    reference = copy.deepcopy(model)
    ours = fp8amp.optim.AdamW(model.parameters(), lr=1e-2, state_dtypes=state_dtypes)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        if step == 1:
            for m in (model, reference):
                m.to(memory_format=torch.channels_last)
            assert not model[0].weight.is_contiguous()
        for m, opt in ((model, ours), (reference, theirs)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    tolerance = 1e-6 if state_dtypes == "O1" else 2e-3  # O2: FP8/FP16 moments
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.is_contiguous() == r.is_contiguous()
        assert (p - r).abs().max() < tolerance
