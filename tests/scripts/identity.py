"""Run by tests through `unified launch`: report identity and a collective as one JSON line."""
import json
import sys

import unified

accelerator = unified.Accelerator(timeout=60)
logger = unified.get_logger("identity", log_level="INFO")
accelerator.wait_for_everyone()
everyone = accelerator.gather_object(accelerator.process_index)
logger.info("main-only message")
logger.info("every-process message", main_process_only=False)
print("RESULT " + json.dumps({
    "index": accelerator.process_index, "local": accelerator.local_process_index,
    "num": accelerator.num_processes, "everyone": everyone, "backend": accelerator.backend,
}), flush=True)
accelerator.end_training()
sys.exit(0)
