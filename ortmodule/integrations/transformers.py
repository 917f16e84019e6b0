"""Hugging Face ``transformers`` integration: a Trainer that saves an ORTModule like the plain model.

``transformers.Trainer.save_model`` (and every checkpoint it writes) calls ``save_pretrained`` only
on a ``PreTrainedModel``; it unwraps DDP / FSDP / DeepSpeed / compiled wrappers, but not ORTModule,
so a wrapped model was saved as a bare ``model.safetensors`` without ``config.json``.
:class:`ORTTrainer` is ``transformers.Trainer`` with that one difference: the wrapped model saves
itself (config, weights, generation config), so ``from_pretrained`` reloads the checkpoint.
"""

from __future__ import annotations

import transformers

from ..module import ORTModule


class ORTTrainer(transformers.Trainer):
    """``transformers.Trainer`` for ``model=ORTModule(pretrained_model)``; saves like the plain model."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        wrapped = self.model
        if isinstance(wrapped, ORTModule) and isinstance(wrapped.module, transformers.PreTrainedModel):
            self.model = wrapped.module  # the same parameters: nothing is copied
            try:
                return super()._save(output_dir, state_dict)
            finally:
                self.model = wrapped
        return super()._save(output_dir, state_dict)


__all__ = ["ORTTrainer"]
