"""The learning-rate schedule: megatron's linear warm-up and cosine decay to --min-lr at
--train-steps, and how it continues when a resumed run asks for another --train-steps
(`--extend-schedule`).

A resume restores the schedule the checkpoint was saved with (megatron takes the checkpoint's
values over the new ones), so a longer --train-steps alone would run every step past the old
end at --min-lr. `--extend-schedule` instead continues from where the checkpoint stands:

- at step s (the checkpoint's) with learning rate lr_s, after warm-up, the learning rate of the
  later steps n is a new cosine from lr_s down to --min-lr at the new --train-steps T:
      lr(n) = min_lr + (lr_s - min_lr) * 0.5 * (1 + cos(pi * (n - s) / (T - s)))
  continuous at s (no jump: the optimizer state and the model are tuned to lr_s), at --min-lr
  from T on. A checkpoint already at the end of its decay (lr_s = min_lr) continues at
  --min-lr; with --min-lr 0 nothing would train, and that resume is refused.
- a checkpoint still in its warm-up keeps the warm-up and decays from the peak to the new T:
  the schedule it would have had with T from the start.

The restretched decay's start (s and lr_s, as the fraction of lr - min_lr) is part of the
scheduler's state, so later resumes of the extended run follow the same curve.
"""

from __future__ import annotations

import math

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from train.config import ConfigError


class RunSchedule(OptimizerParamScheduler):
    """megatron's warm-up + cosine scheduler whose decay a resume can restretch (`extend`)."""

    def __init__(self, *args, **kwargs):
        # (step, fraction of max_lr - min_lr there) where a restretched cosine starts; None: megatron's own
        self.decay_from: tuple[int, float] | None = None
        super().__init__(*args, **kwargs)

    def get_lr(self, param_group: dict) -> float:
        if self.decay_from is None or self.num_steps < self.decay_from[0]:
            return super().get_lr(param_group)
        start, fraction = self.decay_from
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.num_steps >= self.lr_decay_steps:
            return min_lr
        ratio = (self.num_steps - start) / (self.lr_decay_steps - start)
        return min_lr + (max_lr - min_lr) * fraction * 0.5 * (math.cos(math.pi * ratio) + 1.0)

    def extend(self, train_steps: int, new_run: str) -> str:
        """Restretch the decay from the current step to end at `train_steps`; returns a line for
        the log that says how the learning rate continues. ConfigError if nothing would train
        (`new_run`: how to start a new run from the checkpoint instead)."""
        step, old_end = self.num_steps, self.lr_decay_steps
        group = self.optimizer.param_groups[0]
        lr_now = self.get_lr(group)
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if train_steps <= step:
            raise ConfigError(f"--extend-schedule --train-steps {train_steps}: the checkpoint is at step {step}; "
                              f"give a --train-steps past it")
        if step <= self.lr_warmup_steps:
            self.decay_from = None  # still warming up: warm-up as before, then the decay to the new end
            how = (f"the warm-up goes on to --lr {max_lr:g} at step {self.lr_warmup_steps}, then the cosine decays "
                   f"to --min-lr {min_lr:g} at step {train_steps}")
        else:
            fraction = max(0.0, (lr_now - min_lr) / (max_lr - min_lr)) if max_lr > min_lr else 1.0
            if fraction <= 0 and min_lr == 0:
                raise ConfigError(f"--extend-schedule: the checkpoint's schedule ended at step {old_end} with "
                                  f"--min-lr 0, so a continued decay stays at 0 and nothing would train; start a new "
                                  f"run (a new warm-up and decay) from its weights: {new_run}")
            self.decay_from = (step, fraction)
            how = (f"the learning rate continues from {lr_now:.6g} at step {step} on a cosine down to --min-lr "
                   f"{min_lr:g} at step {train_steps}" if fraction > 0 else
                   f"the learning rate stays at --min-lr {min_lr:g}, where the schedule ended, to step {train_steps}")
        self.lr_decay_steps = self.wd_incr_steps = train_steps
        self.step(0)  # the live param groups' lr
        return f"--extend-schedule: the checkpoint's schedule decayed to step {old_end}; {how}"

    def state_dict(self) -> dict:
        return {**super().state_dict(), "decay_from": list(self.decay_from) if self.decay_from else None}

    def load_state_dict(self, state_dict: dict) -> None:
        decay_from = state_dict.get("decay_from")
        self.decay_from = (int(decay_from[0]), float(decay_from[1])) if decay_from else None
        super().load_state_dict(state_dict)  # ends with step(): the live lr follows decay_from
