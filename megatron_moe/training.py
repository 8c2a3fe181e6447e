"""The training loop: distributed setup, data, model, optimizer, steps, eval, checkpoints, logs.

One iteration = one global batch = `global / (micro * DP)` micro-batches per
rank with gradient accumulation; each micro-batch's loss is
(lm + aux) / num_micro so the accumulated gradient is the global-batch mean.
Gradient all-reduce (dense over DP, experts over expert-DP) starts from
grad-ready hooks during the last micro-batch's backward (`GradSync`), or is
handed to Lina's scheduler with --lina.
"""
from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.arguments import config_to_dict, validate
from megatron_moe.checkpointing import load_checkpoint, save_checkpoint
from megatron_moe.distributed.comm_errors import guard
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.logging import MetricsLogger, setup_console
from megatron_moe.model.fused import kernel_report
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.optim import build_optimizer, clip_gradients, lr_at
from megatron_moe.parallel_state import initialize_model_parallel, local_state

DEFAULT_DATA_PREFIX = os.path.join("data", "processed", "wikitext-sample")


def init_distributed(cfg):
    """Process group from torchrun's env (or one process without it) and the layout's groups."""
    p = cfg.parallel
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        if (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size) != (1, 1, 1):
            raise ValueError("parallel sizes > 1 need several processes: launch with torchrun --nproc-per-node N")
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return local_state(), device
    backend = p.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=p.comm_timeout))
    validate(cfg, dist.get_world_size())
    ps = initialize_model_parallel(p.tensor_model_parallel_size, p.expert_model_parallel_size,
                                   p.expert_sharding_parallel_size, backend, timeout_s=p.comm_timeout)
    return ps, device


def prepare_data(cfg, ps) -> None:
    """Default data: preprocess the bundled sample corpus once (rank 0), then read its vocab size."""
    if cfg.data.data_path is None:
        from megatron_moe.data.preprocess import prepare_sample_data
        if ps.global_rank == 0:
            prepare_sample_data(DEFAULT_DATA_PREFIX)
        if ps.layout.world_size > 1:
            dist.barrier()
        cfg.data.data_path = DEFAULT_DATA_PREFIX
    if cfg.model.vocab_size == 0:
        from megatron_moe.data.tokenizer import load_tokenizer
        tok_dir = cfg.data.tokenizer_name_or_path or f"{cfg.data.data_path}_tokenizer"
        if not os.path.exists(tok_dir):
            raise FileNotFoundError(f"--vocab-size not given and no tokenizer at {tok_dir}: pass "
                                    f"--vocab-size or --tokenizer-name-or-path")
        cfg.model.vocab_size = load_tokenizer(tok_dir).vocab_size


def build_loaders(cfg, ps, consumed: int):
    from megatron_moe.data.sampler import build_train_valid_test_data_loaders
    t = cfg.train
    gb = t.global_batch_size
    eval_samples = t.eval_iters * gb if t.eval_iters > 0 else 0
    return build_train_valid_test_data_loaders(
        cfg.data.data_path, cfg.model.seq_length, t.seed, t.micro_batch_size, gb, ps.rank("dp"), ps.size("dp"),
        train_samples=t.train_iters * gb, valid_samples=eval_samples, test_samples=eval_samples,
        consumed_train_samples=consumed, num_workers=cfg.data.num_workers)


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token (6 x active params + attention), for the TFLOP/s estimate."""
    m, moe = cfg.model, cfg.moe
    L, M, H, T = m.num_layers, m.hidden_size, m.ffn_hidden_size, m.seq_length
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    dense = L * 4 * M * M + (L - n_moe) * 2 * M * H + cfg.padded_vocab_size * M
    active = n_moe * (moe.moe_router_topk * 2 * M * H + moe.num_experts * M)
    return 6 * (dense + active) + 12 * L * T * M


class Trainer:
    """Holds everything of one run; `train()` runs it."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ps, self.device = init_distributed(cfg)
        setup_console(self.ps.global_rank)
        if self.ps.layout.world_size == 1:
            validate(cfg, 1)
        torch.manual_seed(cfg.train.seed)
        prepare_data(cfg, self.ps)
        self.model = GPT2MoE(cfg, self.ps).to(self.device)
        self.optimizer, opt_name = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = None
        if cfg.opts.lina:
            from megatron_moe.distributed.lina import LinaScheduler
            self.scheduler = LinaScheduler(cfg.opts.lina_partition_mb, cfg.parallel.comm_timeout)
        self.grad_sync = GradSync(self.model, self.ps, scheduler=self.scheduler)
        self.lancet = None
        if cfg.opts.lancet_wgrad or cfg.opts.lancet_partition:
            from megatron_moe import lancet
            self.lancet = lancet.setup(self.model, self.ps, cfg.opts)
        self.iteration, self.consumed = 0, 0
        if cfg.train.load:
            meta = load_checkpoint(cfg.train.load, self.model, self.optimizer, self.ps)
            self.iteration, self.consumed = meta["iteration"], meta["consumed_samples"]
        self.is_logger = self.ps.global_rank == self.ps.layout.world_size - 1
        self.logger = MetricsLogger(cfg, self.is_logger, config_to_dict(cfg))
        self.train_loader, self.valid_loader, self.test_loader = build_loaders(cfg, self.ps, self.consumed)
        self.num_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.ps.size("dp"))
        n_params = sum(p.numel() for p in self.model.parameters())
        lay = self.ps.layout
        self.logger.line(f"> layout: world {lay.world_size} MP{lay.mp} EP{lay.ep} ESP{lay.esp} DP{lay.dp} "
                         f"expert-DP{lay.expert_dp}; params on this rank {n_params / 1e6:.2f}M; "
                         f"vocab {cfg.model.vocab_size} (padded {cfg.padded_vocab_size})")
        self.logger.line(f"> kernels: {kernel_report()}; optimizer {opt_name}; "
                         f"MoE schedule per layer: {[l.schedule for l in self.model.moe_layers()]}")

    # ------------------------------------------------------------------ one iteration
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.optim.bf16)

    def micro_batch(self, batch):
        tokens = batch["tokens"].to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step(self, batches) -> dict:
        lr = lr_at(self.iteration, self.cfg.optim)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum, aux_sum, dropped, choices, loads = 0.0, 0.0, 0, 0, []
        for i, batch in enumerate(batches):
            ids, labels = self.micro_batch(batch)
            self.grad_sync.accumulating = i < len(batches) - 1
            with self.autocast():
                lm, aux = self.model(ids, labels)
            loss = (lm + aux) / len(batches)
            if self.lancet is not None:
                self.lancet.backward(loss)     # runs deferred dW under the all-to-alls, then flushes
            else:
                loss.backward()
            lm_sum += lm.item()
            aux_sum += float(aux.detach())
            for layer in self.model.moe_layers():
                st = layer.last_stats
                dropped, choices = dropped + st["dropped"], choices + st["choices"]
                loads.append(st["counts"].float())
        self.grad_sync.finish()
        norm = clip_gradients(self.model, self.ps, self.cfg.optim.clip_grad)
        self.optimizer.step()
        stats = torch.tensor([lm_sum / len(batches), aux_sum / len(batches), dropped, choices], dtype=torch.float64)
        stats = self.average_over_dp(stats)
        load = torch.stack(loads).sum(0) if loads else torch.zeros(1)
        imbalance = float(load.max() / load.mean()) if loads and load.mean() > 0 else 1.0
        return {"loss": float(stats[0]), "aux_loss": float(stats[1]), "lr": lr, "grad_norm": norm,
                "dropped_frac": float(stats[2] / stats[3]) if stats[3] > 0 else 0.0,
                "load_imbalance": imbalance, "expert_load": load.tolist()}

    def average_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.ps.size("dp") > 1:
            t = t.to(self.device)
            with guard("loss all_reduce", self.ps.group("dp")):
                dist.all_reduce(t, group=self.ps.group("dp"))
            t = t.cpu() / self.ps.size("dp")
        return t

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, loader, split: str) -> Optional[dict]:
        if loader is None:
            return None
        self.model.eval()
        total, n = 0.0, 0
        for batch in loader:
            ids, labels = self.micro_batch(batch)
            with self.autocast():
                lm, _ = self.model(ids, labels)
            total, n = total + lm.item(), n + 1
        self.model.train()
        loss = float(self.average_over_dp(torch.tensor([total / max(n, 1)], dtype=torch.float64))[0])
        rec = {"split": split, "iteration": self.iteration, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
        self.logger.line(f" {split} at iteration {self.iteration:6d} | lm loss {loss:.4f} | ppl {rec['ppl']:.2f}")
        self.logger.record(rec, self.iteration)
        return rec

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.train
        history: list[dict] = []
        it = iter(self.train_loader)
        bar = None
        if self.is_logger and sys.stdout.isatty():
            from tqdm import tqdm
            bar = tqdm(total=t.train_iters, initial=self.iteration, desc="train", leave=False)
        tokens_per_iter = t.global_batch_size * cfg.model.seq_length
        flops_per_iter = model_flops_per_token(cfg) * tokens_per_iter
        start_iter = self.iteration
        while self.iteration < t.train_iters:
            t0 = time.perf_counter()
            rec = self.train_step([next(it) for _ in range(self.num_micro)])
            self.iteration += 1
            self.consumed += t.global_batch_size
            dt = time.perf_counter() - t0
            load = rec.pop("expert_load")
            rec.update(iteration=self.iteration, consumed_samples=self.consumed, ms_per_iter=dt * 1e3,
                       tokens_per_s=tokens_per_iter / dt,
                       tflops=flops_per_iter / dt / 1e12 / self.ps.layout.world_size)
            history.append(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}")
            if self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                self.log_train(rec, load)
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                self.evaluate(self.valid_loader, "valid")
            if t.save and t.save_interval and self.iteration % t.save_interval == 0:
                save_checkpoint(t.save, self.iteration, self.consumed, self.model, self.optimizer, cfg, self.ps)
            if t.exit_interval and self.iteration - start_iter >= t.exit_interval:
                break
        if bar is not None:
            bar.close()
        if t.save and (not t.save_interval or self.iteration % t.save_interval):
            save_checkpoint(t.save, self.iteration, self.consumed, self.model, self.optimizer, cfg, self.ps)
        if self.iteration >= t.train_iters:
            if not (t.eval_interval and self.iteration % t.eval_interval == 0):   # not just evaluated
                self.evaluate(self.valid_loader, "valid")
            self.evaluate(self.test_loader, "test")
        self.finish(history)
        return history

    def log_train(self, rec: dict, load) -> None:
        self.logger.line(
            f" iteration {rec['iteration']:6d}/{self.cfg.train.train_iters} | consumed samples {rec['consumed_samples']:8d}"
            f" | lr {rec['lr']:.3e} | lm loss {rec['loss']:.4f} | aux loss {rec['aux_loss']:.4f}"
            f" | grad norm {rec['grad_norm']:.3f} | ms/iter {rec['ms_per_iter']:.1f}"
            f" | tokens/s {rec['tokens_per_s']:.0f} | TFLOP/s/rank {rec['tflops']:.4f}"
            f" | dropped {100 * rec['dropped_frac']:.2f}% | load imbalance {rec['load_imbalance']:.2f}")
        self.logger.record(rec, rec["iteration"], histograms={"expert_load": load})

    def finish(self, history: Optional[list] = None) -> None:
        if self.lancet is not None and self.cfg.opts.lancet_report:
            times = sorted(h["ms_per_iter"] for h in (history or [])[1:]) or [None]
            self.lancet.write_report(measured_iter_ms=times[len(times) // 2])
        self.grad_sync.remove()
        self.logger.close()


def pretrain(cfg) -> list[dict]:
    """Build a Trainer and run it; returns the per-iteration records of this rank."""
    return Trainer(cfg).train()
