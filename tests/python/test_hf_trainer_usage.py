"""The Hugging Face Trainer's features with an fp8amp model and optimizer, as its users run them
(CPU, tiny models built from configs, nothing downloaded), each against the same Trainer run on
the unconverted model with torch's AdamW: the number of steps, the lr schedule, the loss within
FP8 distance and the FP8 scaling updated once a step."""

import pytest
import torch

import fp8amp
from fp8amp.amax_sync import delayed_states
from hf_models import tiny_llama

transformers = pytest.importorskip("transformers")


def _windows(n=16, seq=32):
    ids = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


class Fp8Trainer(transformers.Trainer):
    """The create_optimizer override of docs/integrations.md."""

    def create_optimizer(self, model=None):
        super().create_optimizer()
        self.optimizer = fp8amp.initialize_optimizer(self.model, self.optimizer, "O2")
        return self.optimizer


def _trainer(tmp_path, converted, eval_dataset=None, **args):
    model = tiny_llama()
    args = transformers.TrainingArguments(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 4,
                                             "learning_rate": 3e-3, "report_to": [], "use_cpu": True,
                                             "disable_tqdm": True, "save_strategy": "no", "seed": 0,
                                             "logging_steps": 1, **args})
    if not converted:
        return model, transformers.Trainer(model=model, args=args, train_dataset=_windows(), eval_dataset=eval_dataset)
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    return model, Fp8Trainer(model=model, args=args, train_dataset=_windows(), eval_dataset=eval_dataset)


def _logged(trainer, key):
    return [(entry["step"], entry[key]) for entry in trainer.state.log_history if key in entry]


def test_train_called_twice_goes_on_with_the_same_optimizer(tmp_path):
    """A second trainer.train() calls create_optimizer again with the optimizer the first one
    prepared (Accelerate's wrapper of fp8amp's): it goes on with it, as the plain Trainer goes on
    with its own (initialize_optimizer refused the wrapper)."""
    runs = {}
    for converted in (False, True):
        model, trainer = _trainer(tmp_path / str(converted), converted, max_steps=3, gradient_accumulation_steps=2)
        trainer.train()
        first = trainer.optimizer
        trainer.train()
        assert trainer.optimizer is first
        optimizer = getattr(first, "optimizer", first)
        assert float(next(iter(optimizer.state.values()))["step"]) == 6
        runs[converted] = model, trainer
    model, trainer = runs[True]
    assert isinstance(trainer.optimizer.optimizer, fp8amp.optim.AdamW)
    assert {int(c) for s in delayed_states(model) for c in s.counter.flatten().tolist()} == {6}
    expected, got = _logged(runs[False][1], "loss"), _logged(trainer, "loss")
    assert [s for s, _ in got] == [s for s, _ in expected] == [1, 2, 3]  # the second run's
    assert _logged(trainer, "learning_rate") == _logged(runs[False][1], "learning_rate")
    assert all(abs(a - b) < 0.05 * a for (_, a), (_, b) in zip(expected, got))


def test_the_same_trainer_resumes_after_loading_its_best_checkpoint(tmp_path):
    """train() with load_best_model_at_end (the best checkpoint, the first, loaded back into the
    converted model), then train(resume_from_checkpoint=...) on the same Trainer: the resumed
    steps log the same losses and evaluations bit for bit, and the best checkpoint's scaling is
    loaded back again (its counters: 2 steps)."""
    model, trainer = _trainer(tmp_path, True, _windows(n=8)[::-1], max_steps=6, gradient_accumulation_steps=2,
                              eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                              load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    losses, evals = _logged(trainer, "loss"), _logged(trainer, "eval_loss")
    trainer.args.output_dir = str(tmp_path / "resumed")
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 6
    assert _logged(trainer, "loss") == losses and _logged(trainer, "eval_loss") == evals
    assert {int(c) for s in delayed_states(model) for c in s.counter.flatten().tolist()} == {2}


def test_full_eval_in_bfloat16_names_the_trainer_option(tmp_path):
    """bf16_full_eval casts the model to bfloat16 for an evaluate() outside training: refused at
    O2 (the masters keep their dtype), with the Trainer's option named and bf16=True (autocast)
    as what works; during training (eval_strategy) the Trainer does not cast, and it runs."""
    model, trainer = _trainer(tmp_path, True, _windows(n=4), max_steps=2, bf16_full_eval=True, eval_strategy="steps",
                              eval_steps=2)
    trainer.train()
    assert [s for s, _ in _logged(trainer, "eval_loss")] == [2]
    with pytest.raises(ValueError, match=r"cannot become torch.bfloat16.*bf16_full_eval.*bf16=True"):
        trainer.evaluate()
