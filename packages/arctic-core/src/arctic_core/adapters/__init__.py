"""What every framework adapter (arctic-trl, arctic-verl, arctic-skyrl, arctic-primerl) shares: an
adapter writes its framework's seam classes and a mapping (:mod:`.mapping`), and takes the rest
from here: start-up checks, opening the backend, grouped sampling, the framework's learning-rate
schedule, metric names, the Hugging Face export's place. See docs/design/adapters.md."""
