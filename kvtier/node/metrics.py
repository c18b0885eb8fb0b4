"""The node server's Prometheus metrics: per namespace (pool bytes used and pinned, entries, hits,
hits on another engine's entries, stores, evictions), per engine that stored entries (bytes held,
stores, other engines' hits on them, evictions; the engines gone, together as "departed") and per
connected engine (pins, connections)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def prometheus(stats: dict) -> str:
    """The server's counters in Prometheus's text format."""
    lines = []

    def metric(name, kind, help_text, samples):
        lines.extend([f"# HELP kvtier_node_{name} {help_text}", f"# TYPE kvtier_node_{name} {kind}"])
        for labels, value in samples:
            text = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
            lines.append(f"kvtier_node_{name}{{{text}}} {value}" if text else f"kvtier_node_{name} {value}")

    spaces = stats["namespaces"]
    page = stats["page_bytes"]
    metric("pool_bytes", "gauge", "Bytes of the node's host pool.", [({}, stats["arena_bytes"])])
    metric("pool_used_bytes", "gauge", "Bytes of the host pool holding entries, per namespace.",
           [({"namespace": ns}, s["pages_used"] * page) for ns, s in spaces.items()])
    metric("pool_pinned_bytes", "gauge", "Bytes of the host pool pinned by loads and writes, per namespace.",
           [({"namespace": ns}, s["pages_pinned"] * page) for ns, s in spaces.items()])
    metric("entries", "gauge", "Entries in the host pool, per namespace.",
           [({"namespace": ns}, s["entries"]) for ns, s in spaces.items()])
    for counter, help_text in (("hits", "Entries served from the host pool"),
                               ("hits_other_engine", "Entries served to an engine other than the one that stored them"),
                               ("stores", "Entries stored"), ("evictions", "Entries evicted from the host pool"),
                               ("refused_stores", "Stores refused for want of room")):
        metric(f"{counter}_total", "counter", f"{help_text}, per namespace.",
               [({"namespace": ns}, s[counter]) for ns, s in spaces.items()])
    stored_by = stats["stored_by"]  # connected engines, and "departed"
    metric("engine_used_bytes", "gauge", "Bytes of the host pool holding the entries each engine stored.",
           [({"engine": e}, s["pages_used"] * page) for e, s in stored_by.items()])
    for counter, help_text in (("stores", "Entries each engine stored"),
                               ("hits_served_to_others", "Other engines' hits on the entries each engine stored"),
                               ("evictions", "Evictions of the entries each engine stored")):
        metric(f"engine_{counter}_total", "counter", help_text + ".", [({"engine": e}, s[counter])
                                                                       for e, s in stored_by.items()])
    metric("engine_pins", "gauge", "Pins each connected engine holds.",
           [({"engine": e}, s["pins"]) for e, s in stats["engines"].items()])
    metric("engine_connections", "gauge", "Connections of each engine.",
           [({"engine": e}, s["connections"]) for e, s in stats["engines"].items()])
    for counter in ("refused_uid", "refused_protocol", "disk_reads", "disk_skipped", "released_holds"):
        metric(f"{counter}_total", "counter", counter.replace("_", " ") + ".", [({}, stats[counter])])
    if "events" in stats:
        for counter in ("events_published", "events_dropped"):
            metric(f"{counter}_total", "counter", "KV events " + counter[7:] + ".", [({}, stats["events"][counter])])
        if stats["events"]["replay_endpoint"] is not None:
            metric("events_replays_total", "counter", "Replay requests answered.", [({}, stats["events"]["replays"])])
    if "on_disk" in stats:
        metric("disk_bytes", "gauge", "Bytes of entries on the node's disk.", [({}, stats["on_disk"]["bytes"])])
        metric("disk_entries", "gauge", "Entries on the node's disk.", [({}, stats["on_disk"]["entries"])])
    return "\n".join(lines) + "\n"


def _escaped(value) -> str:
    """A label value as the text format quotes it (an engine names itself)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def serve_metrics(port: int, render, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """``render()`` at http://HOST:PORT/metrics, on a thread of its own (0: a free port). Loopback unless
    configured: the metrics name the engines and namespaces of the node."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return None

    http = ThreadingHTTPServer((host, port), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True, name="kvtier-node-metrics").start()
    return http
