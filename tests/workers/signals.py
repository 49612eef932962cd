"""Report the signal each rank receives to OUT/got-<r>, then exit 0; or (ignore) never exit on SIGTERM, and
from then on write the time to OUT/alive-<r> every 10 ms, showing how long it lived after the signal."""

import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
signalled = False


def on_signal(signum, _frame):
    global signalled
    with open(os.path.join(out, f"got-{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    signalled = True
    if mode == "graceful":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
with open(os.path.join(out, f"ready-{rank}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    if signalled:
        with open(os.path.join(out, f"alive-{rank}.tmp"), "w") as f:
            f.write(repr(time.time()))
        os.replace(os.path.join(out, f"alive-{rank}.tmp"), os.path.join(out, f"alive-{rank}"))
    time.sleep(0.01)
