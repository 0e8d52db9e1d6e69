"""SkyRL's experiment (``BasePPOExp``) with Arctic in place of its GPU workers and vLLM engines."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
from skyrl.train.dataset import PromptDataset
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend

from arctic_core.adapters.backend import async_connect
from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient
from arctic_skyrl.dispatch import ArcticDispatch
from arctic_skyrl.inference import ArcticInferenceClient
from arctic_skyrl.settings import ArcticSkyRLConfig
from arctic_skyrl.trainer import ArcticTrainer

# SkyRL filters its prompt files with 8 worker processes. Starting them costs more than the work
# for small files (tens of seconds, on 2 cores as on 16): one process up to this many prompts, then
# at most half the cores.
SMALL_DATASET_ROWS = 20_000


def dataset_workers(files: list[str]) -> int:
    """Worker processes for filtering ``files``: 1 for small parquet files, else up to 8."""
    try:
        rows = sum(pq.ParquetFile(os.path.expanduser(f)).metadata.num_rows for f in files)
    except (OSError, ValueError):  # not a parquet file (json, a hub name): SkyRL's loader decides
        rows = None
    if rows is not None and rows <= SMALL_DATASET_ROWS:
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


class ArcticPPOExp(BasePPOExp):
    """Builds SkyRL's tracker, generator and trainer as ``BasePPOExp`` does, with Arctic serving
    generation and training."""

    def __init__(self, cfg: ArcticSkyRLConfig, settings: BackendSettings, arctic: ArcticClient) -> None:
        self.settings, self.arctic = settings, arctic
        super().__init__(cfg)

    def _prompt_dataset(self, files: list[str]) -> PromptDataset:
        return PromptDataset(datasets=files, tokenizer=self.tokenizer,
                             max_prompt_length=self.cfg.trainer.max_prompt_length,
                             num_workers=dataset_workers(files))

    def get_train_dataset(self) -> PromptDataset:
        dataset = self._prompt_dataset(self.cfg.data.train_data)
        if len(dataset) < self.cfg.trainer.train_batch_size:
            raise ValueError(f"data.train_data has {len(dataset)} prompts "
                             "(after filtering by trainer.max_prompt_length), "
                             f"fewer than trainer.train_batch_size={self.cfg.trainer.train_batch_size}")
        return dataset

    def get_eval_dataset(self) -> PromptDataset | None:
        if self.cfg.trainer.eval_interval > 0 and self.cfg.data.val_data:
            return self._prompt_dataset(self.cfg.data.val_data)
        return None

    def get_colocate_pg(self, timeout: int = 0) -> None:
        """No placement group: Arctic places its engines itself."""
        return None

    def get_inference_client(self) -> ArcticInferenceClient:
        sampling = get_sampling_params_for_backend("vllm", self.cfg.generator.sampling_params)
        return ArcticInferenceClient(async_connect(self.arctic, self.settings), self.tokenizer,
                                     str(self.cfg.trainer.policy.model.path), sampling, self.settings)

    def _setup_trainer(self) -> ArcticTrainer:
        cfg = self.cfg
        os.makedirs(cfg.trainer.export_path, exist_ok=True)
        os.makedirs(cfg.trainer.ckpt_path, exist_ok=True)
        inference_client = self.get_inference_client()
        trainer = ArcticTrainer(
            cfg=cfg, tracker=self.get_tracker(), tokenizer=self.tokenizer, train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset, inference_engine_client=inference_client,
            generator=self.get_generator(cfg, self.tokenizer, inference_client), colocate_pg=None)
        trainer.trajectory_logger = self.get_trajectory_logger()
        self.trainer = trainer
        updates_per_batch = (cfg.trainer.train_batch_size // cfg.trainer.policy_mini_batch_size
                             * cfg.trainer.update_epochs_per_batch)
        trainer.dispatch = ArcticDispatch(cfg, self.arctic, trainer.total_training_steps * updates_per_batch)
        return trainer
