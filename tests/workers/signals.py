"""Report the signal each rank receives to OUT/got-<r>, then exit 0; or (ignore) never exit on SIGTERM."""

import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]


def on_signal(signum, _frame):
    with open(os.path.join(out, f"got-{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    if mode == "graceful":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
with open(os.path.join(out, f"ready-{rank}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
