"""Run by test_integration_lightning_strategies.py under ``torch.distributed.run`` (2 CPU processes,
gloo), one after the other in the same processes: a Lightning Trainer with fp8amp's plugin under
the DDP strategy (FP8 gradient all-reduce as the comm hook), the Trainer under
ModelParallelStrategy (FSDP2's ``fully_shard`` in ``configure_model``), and Fabric's DDP strategy
with fp8amp's Fabric plugin. Rank 0 prints one ``RESULT <run> <json>`` line a run."""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

import fp8amp
from fp8amp.integrations.lightning import Fp8ampFabricPrecision, Fp8ampPrecision


class Regression(L.LightningModule):
    def __init__(self, fsdp: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
        self.fsdp = fsdp
        self.losses = []

    def configure_model(self):
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        # fp8amp first (the O2 masters are what FSDP2 shards), then fully_shard: Lightning calls the
        # plugin's convert_module only after this hook, and it leaves a converted model as it is.
        fp8amp.initialize(self, None, "O2")
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # not the LightningModule: training_step is not its forward

    def on_train_start(self):
        if not self.fsdp:  # the DDP module exists while fit runs (Lightning unwraps it at the end)
            self.comm_hook = self.trainer.strategy.model._get_ddp_logging_data().get("comm_hook")

    def forward(self, x):  # Fabric calls the module itself
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(160, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def ranks_agree(module: nn.Module) -> bool:
    flat = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def trainer_run(mode: str) -> dict:
    if mode == "ddp":
        strategy, plugin = DDPStrategy(), Fp8ampPrecision("O2", autocast_dtype=None, fp8_allreduce=True)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        plugin = Fp8ampPrecision("O2", autocast_dtype=None)
    module = Regression(fsdp=mode == "fsdp")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], max_epochs=1,
                        gradient_clip_val=1.0 if mode == "ddp" else None, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data())  # 8 steps a rank: the sampler splits the 16 batches
    optimizer = trainer.optimizers[0]
    weight = module.net[0].weight
    out = dict(world=dist.get_world_size(), losses=module.losses, optimizer=type(optimizer).__qualname__,
               state_dtypes=optimizer.param_groups[0]["state_dtypes"],
               fp8_layer=isinstance(module.net[0], fp8amp.Fp8Linear))
    if mode == "ddp":
        out["comm_hook"] = module.comm_hook
        out["ranks_agree"] = ranks_agree(module)
        out["input_amaxes"] = int(module.net[0].input_scaling.amax_history[0].count_nonzero())
    else:
        out["weight"] = type(weight).__name__
        out["local"] = type(weight.to_local()).__name__
        out["local_rows"] = weight.to_local().shape[0]
        out["m_dtype"] = str(optimizer.state[weight]["exp_avg"].dtype)
    return out


def fabric_ddp_run() -> dict:
    precision = Fp8ampFabricPrecision("O2", autocast_dtype=None)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[precision])
    fabric.launch()  # the processes are torchrun's: nothing to start
    module = Regression(fsdp=False)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(precision.convert_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)))
    losses = []
    for x, y in fabric.setup_dataloaders(data()):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)  # through DDP's forward: its reducer syncs
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return dict(world=dist.get_world_size(), losses=losses, ddp=type(model._forward_module).__name__,
                optimizer=type(optimizer.optimizer).__qualname__, fp8_layer=isinstance(module.net[0], fp8amp.Fp8Linear),
                ranks_agree=ranks_agree(module))


def main() -> None:
    for mode in ("ddp", "fsdp", "fabric-ddp"):  # one process start for the three (lightning's import is slow)
        out = fabric_ddp_run() if mode == "fabric-ddp" else trainer_run(mode)
        if dist.get_rank() == 0:
            print(f"RESULT {mode} " + json.dumps(out), flush=True)
    # Every run is done and printed: end the process here. The interpreter's own exit sometimes
    # aborted in a C++ destructor (std::terminate, "terminate called without an active exception",
    # about 1 run in 8 on a 2-core machine), even with the process group destroyed first and no
    # Python thread left; this script without fp8amp (no plugin, not imported) aborted as often.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
