"""A progress line for the long-running tools (bench, trace replay): standard library only."""

import shutil
import sys
import threading


class Progress:
    """One updating status line on a terminal (``\\r``), plain lines otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._width = 0
        self._lock = threading.Lock()

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self.tty:
                cols = shutil.get_terminal_size((100, 20)).columns - 1
                text = text[:cols]
                self.stream.write("\r" + text.ljust(self._width))
                self._width = len(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def clear(self) -> None:
        if self.tty and self._width:
            with self._lock:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._width = 0
