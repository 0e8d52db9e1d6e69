"""Weight sync from the trainer to the samplers: in process (``inprocess``), safetensors files
(``files``), a torch.distributed broadcast between Ray actors (``broadcast``), CUDA IPC handles
(``ipc``), and the actor side they share (``actor``)."""
