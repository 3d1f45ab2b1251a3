"""Traffic for datapath tests, run inside a pod's namespace with ``ip netns exec NAME python netprobe.py``.

serve PORT [PORT...]          accept TCP on each port; count bytes received (printed on each accept/close)
connect IP PORT TIMEOUT       exit 0 if a TCP connection opens within TIMEOUT seconds, 1 otherwise
stream IP PORT SECONDS        send for SECONDS; exit 0 if every send succeeded, print bytes sent
probe IP ALLOWED DENIED N     N rounds, one a second: "round allowed_ok denied_ok" per line
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def serve(ports: list[int]) -> None:
    def handle(conn: socket.socket) -> None:
        total = 0
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                total += len(data)
        print(f"closed {total}", flush=True)

    def accept(port: int) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(64)
        while True:
            conn, _ = s.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    for port in ports:
        threading.Thread(target=accept, args=(port,), daemon=True).start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def connect(ip: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def stream(ip: str, port: int, seconds: float) -> int:
    s = socket.create_connection((ip, port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("connected", flush=True)
    chunk = b"x" * 1024
    sent = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            s.sendall(chunk)  # a dropped segment stalls this; a reset raises
            sent += len(chunk)
            time.sleep(0.002)
    except OSError as exc:
        print(f"failed {sent} {exc}", flush=True)
        return 1
    s.close()
    print(f"sent {sent}", flush=True)
    return 0


def probe(ip: str, allowed: int, denied: int, rounds: int) -> None:
    for n in range(rounds):
        start = time.monotonic()
        ok_allowed = connect(ip, allowed, 2.0)
        ok_denied = connect(ip, denied, 0.5)
        print(f"{n} {int(ok_allowed)} {int(ok_denied)}", flush=True)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - start)))


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "serve":
        serve([int(p) for p in argv[1:]])
    elif mode == "connect":
        return 0 if connect(argv[1], int(argv[2]), float(argv[3])) else 1
    elif mode == "stream":
        return stream(argv[1], int(argv[2]), float(argv[3]))
    elif mode == "probe":
        probe(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
