"""A TCP relay for a replica's link to its master, that can hold the master's stream back.

Pausing a replica (SIGSTOP) does not make a failover lose anything: what the master sent
waits in the replica's socket buffer and is applied once the replica runs again, even
after the master died. Replication lag that a failover does lose is data the master
acknowledged and had not yet delivered; this relay makes it: the replica connects to it
as to its master, and while ``hold`` is on, the master's bytes stay in the relay (the
replica's acknowledgements still flow back, with its old offset). ``stop`` closes every
connection and drops what is held, as a dead master's unsent output buffer is lost.
No pytest dependency; one thread per direction of each connection.
"""

from __future__ import annotations

import socket
import threading

from tests.proxy import _close, _Listener


class ReplicationRelay(_Listener):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream
        self._lock = threading.Lock()
        self._holding = False
        self._held: list[tuple[socket.socket, bytes]] = []
        self._sockets: list[socket.socket] = []

    def hold(self) -> None:
        """Keep what the master sends from now on, instead of passing it to the replica."""
        with self._lock:
            self._holding = True

    def release(self) -> None:
        """Pass on what was held, and what comes after."""
        with self._lock:
            for down, data in self._held:
                down.sendall(data)
            self._held.clear()
            self._holding = False

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(data) for _, data in self._held)

    def stop(self) -> None:
        """Close every connection; what is held is dropped."""
        super().stop()
        with self._lock:
            self._held.clear()
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def handle(self, down: socket.socket) -> None:
        try:
            up = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _close(down)
            return
        up.settimeout(None)
        with self._lock:
            if self._listener is None:  # stopped meanwhile
                _close(down)
                _close(up)
                return
            self._sockets += [down, up]
        threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_master: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    if from_master and self._holding:
                        self._held.append((target, data))
                        continue
                target.sendall(data)
        except OSError:
            pass
        _close(source)
        _close(target)
