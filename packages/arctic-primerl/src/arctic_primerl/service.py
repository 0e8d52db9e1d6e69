"""Arctic serving PRIME-RL: one backend, the inference front on its port, the trainer loop.

Both sides use the same Arctic server: embedded in this process (calls are serialised by the
server, so sampling for the next step and training the current one take turns on the GPU), or the
``arctic-rl serve`` server named by ``[arctic] url``.
"""

from __future__ import annotations

import socket
import threading

import uvicorn
from transformers import AutoTokenizer

from arctic_core.adapters.backend import async_connect, open_backend
from arctic_core.adapters.sampling import end_of_sequence_ids
from arctic_core.demo.metrics import MetricsLogger
from arctic_primerl.config import RunSettings
from arctic_primerl.inference import FrontSettings, chat_defaults, create_front
from arctic_primerl.trainer import RolloutTrainer, RunFolder, TrainerSettings


class ArcticPrimeRL:
    def __init__(self, run: RunSettings, on_gpu: bool) -> None:
        self.run = run
        RunFolder(run.run_dir).prepare(run.resume_step, run.clean)  # before the engines take their time
        self.client, _ = open_backend(run.arctic, lambda: run.arctic_config(on_gpu))
        self._connect = async_connect(self.client, run.arctic)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLogger(run.run_dir / "tensorboard")
        self.trainer = RolloutTrainer(self.client, RunFolder(run.run_dir), TrainerSettings(
            max_steps=run.max_steps, loss_terms=run.loss, learning_rates=run.schedule.rates(),
            start_step=(run.resume_step or 0) + 1, checkpoints=run.checkpoints, ckpt_interval=run.ckpt_interval,
            ckpt_keep_last=run.ckpt_keep_last, ckpt_keep_interval=run.ckpt_keep_interval,
        ), self.metrics)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start_front(self, token: str | None = None) -> str:
        """Serve PRIME-RL's inference routes on ``[arctic] host`` and the run's port (0: any free
        one); returns the base URL."""
        tokenizer = AutoTokenizer.from_pretrained(self.run.model_name)
        front = FrontSettings(
            model_name=self.run.model_name, max_model_len=self.run.arctic.max_model_len or self.run.seq_len,
            eos_token_ids=end_of_sequence_ids(self.run.model_name, tokenizer.eos_token_id), token=token,
            group_quiet_s=self.run.arctic.group_quiet_ms / 1000,
            group_max_wait_s=self.run.arctic.group_max_wait_ms / 1000,
            chat_defaults=chat_defaults(self.run.model_name),
        )
        app = create_front(self._connect, front, lambda: self.trainer.announced, tokenizer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.run.arctic.host, self.run.port))
        sock.listen(256)  # callers wait in the backlog until uvicorn accepts them
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="primerl-front")
        self._thread.start()
        return f"http://{self.run.arctic.host}:{sock.getsockname()[1]}"

    def train(self) -> None:
        self.trainer.run_steps()

    def stop(self) -> None:
        self.trainer.settings.stop.set()
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self.metrics.close()
        if self.run.arctic.starts_backend:
            self.client.shutdown()
        self.client.close()
