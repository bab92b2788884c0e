"""A tiny DNS server for tests: answers A queries for the names it is given, from a UDP socket on
a free loopback port, so that a test can make a name resolve to 127.0.0.1 without /etc/hosts or
the internet (envoy/render.py --fetch-dns-resolver points Envoy's image fetches at it).

Other types of a known name get an empty NOERROR answer, unknown names NXDOMAIN."""
import socket
import struct
import threading


class DnsResponder:
    def __init__(self, names):
        """names: {"images.example.test": "127.0.0.1", ...}"""
        self.names = {n.lower().rstrip("."): socket.inet_aton(a) for n, a in names.items()}
        self.queries = []  # (name, qtype), in arrival order
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = "%s:%d" % self.sock.getsockname()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                query, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            answer = self.answer(query)
            if answer:
                self.sock.sendto(answer, peer)

    def answer(self, query):
        if len(query) < 12:
            return None
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return None
        labels, at = [], 12
        while at < len(query) and query[at] != 0:
            n = query[at]
            labels.append(query[at + 1:at + 1 + n].decode("ascii", "replace"))
            at += 1 + n
        question_end = at + 5
        if question_end > len(query):
            return None
        qtype, _qclass = struct.unpack("!HH", query[at + 1:question_end])
        name = ".".join(labels).lower()
        self.queries.append((name, qtype))
        address = self.names.get(name)
        rcode = 0 if address else 3
        answers = b""
        if address and qtype == 1:
            # A pointer to the question's name (offset 12), type A, class IN, TTL 60 s.
            answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + address
        # QR, the query's RD, RA; one question, its answers, no authority or additional records.
        header = struct.pack("!HHHHHH", qid, 0x8080 | (flags & 0x0100) | rcode, 1,
                             1 if answers else 0, 0, 0)
        return header + query[12:question_end] + answers

    def close(self):
        self.sock.close()
