"""Run by tests through `unified launch`: report identity and a collective as one JSON line, then
draw two progress bars (unified.tqdm and plain tqdm) into the launcher's pipes."""
import json
import sys
import time

from tqdm.auto import tqdm as plain_tqdm

import unified

BAR_STEPS = 50

accelerator = unified.Accelerator(timeout=60)
logger = unified.get_logger("identity", log_level="INFO")
accelerator.wait_for_everyone()
everyone = accelerator.gather_object(accelerator.process_index)
logger.info("main-only message")
logger.info("every-process message", main_process_only=False)
print("RESULT " + json.dumps({
    "index": accelerator.process_index, "local": accelerator.local_process_index,
    "num": accelerator.num_processes, "everyone": everyone, "backend": accelerator.backend,
    "argv": sys.argv[1:],
}), flush=True)
# Each bar would redraw every 0.1 s (unified's at every set_postfix); through the launcher they print
# their first and last state only (tests/test_launcher.py counts the lines).
bar = unified.tqdm(range(BAR_STEPS), desc="unified-bar")
for step in bar:
    time.sleep(0.02)
    bar.set_postfix(step=step)
plain = plain_tqdm(total=BAR_STEPS, desc="plain-bar", disable=not accelerator.is_main_process)
for _ in range(BAR_STEPS):
    time.sleep(0.02)
    plain.update(1)
plain.close()
accelerator.end_training()
sys.exit(0)
