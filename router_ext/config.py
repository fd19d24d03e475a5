"""Write an llm-d ``EndpointPickerConfig`` plus a file-discovery endpoints file.

``moerl router-config --endpoints HOST:PORT[,...] --out DIR`` (entry point:
:func:`main`) produces ``DIR/epp-config.yaml`` and ``DIR/endpoints.yaml`` for
llm-d-router v0.10's standalone mode (no Kubernetes) and prints the command that
starts the picker on them (:func:`epp_command`)::

    moerl-epp --config-file DIR/epp-config.yaml --pool-name moerl --pool-namespace default \
        --secure-serving=false --grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090 \
        --enable-pprof=false --allow-experimental-plugins

``--allow-experimental-plugins`` is required: both moerl plugins register as
Alpha, and without it the picker exits 1 ("plugin 'paused-filter' has Alpha
stability level"). ``--pool-namespace`` is given explicitly (llm-d otherwise
silently uses ``default``). pprof is off. llm-d v0.10 has no bind-address flag:
the gRPC, health and metrics ports listen on every interface, so on a shared
host run the picker where only loopback reaches them (its own network namespace
or a container publishing ``127.0.0.1:PORT`` only, or a host firewall).

The profile is: ``moerl-paused-filter`` (a replica in a weight update is never
a candidate), then ``moerl-rl-scorer`` alone (weight 1; it already folds in
load, queue, KV usage and the prefix match of llm-d's prefix producer, the
approximate one or, with KV events, the precise one, so adding llm-d's own
scorers would count them twice and break parity with the embedded Python
router), then ``max-score-picker``. The core metrics extractor maps vLLM's
standard metrics and, as custom scalar attributes, the two RL metrics that
vllm_ext exports. ``build_llmd_default_config`` writes llm-d's own default
profile instead (its queue, KV-utilisation and prefix-cache scorers), the
baseline ``benchmarks.llmd_e2e`` compares with.

With ``--prefill-endpoints`` the picker disaggregates prefill and decode with llm-d's own
machinery: every endpoint carries its role (``llm-d.ai/role``: ``prefill`` for those,
``decode`` for the others), and llm-d's ``disagg-profile-handler`` runs a ``decode`` profile
(``decode-filter``, then moerl's filter and scorer as above) and, when its
``prefix-based-pd-decider`` finds at least ``--pd-non-cached-tokens`` prompt tokens not cached on
the decode pick, a ``prefill`` profile (``prefill-filter``, moerl's filter and scorer), naming its
pick in ``x-prefiller-host-port``. Whoever forwards the request makes the two hops: llm-d's
``pd-sidecar --kv-connector shared-storage`` in front of each decode replica, or ``moerl rl``
itself (``rl_loop.disagg``). Prefill replicas answer once their KV is in the Mooncake pool
(``vllm_ext.prefill_handoff``), so the decode replica finds it there.

Output is plain YAML written by hand (JSON-compatible scalars only), so this
module needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from router_ext.scorer import ScorerParams

__all__ = ["Disagg", "Endpoint", "EppPorts", "KvEvents", "vllm_kv_events_config", "build_epp_config", "build_endpoints_file",
           "build_llmd_default_config", "epp_command", "main", "parse_endpoints", "to_yaml", "write"]

POLICY_VERSION_METRIC = "moerl:policy_version"
UPDATING_METRIC = "moerl:weight_update_in_progress"
POLICY_VERSION_ATTRIBUTE = "moerl.policy_version"
UPDATING_ATTRIBUTE = "moerl.weight_update_in_progress"
AFFINITY_HEADER = "x-moerl-affinity-key"
ENGINE_LABEL = "llm-d.ai/engine-type"
ROLE_LABEL = "llm-d.ai/role"  # read by llm-d's prefill-filter and decode-filter


@dataclass(frozen=True)
class Endpoint:
    """One vLLM replica: file discovery needs a literal IPv4 and a port."""

    name: str
    address: str
    port: int
    role: str = ""  # "prefill" / "decode" under disaggregation; "" serves both


def parse_endpoints(specs: Iterable[str], role: str = "") -> list[Endpoint]:
    """Parse ``[name=]host:port`` items (comma lists allowed).

    Hostnames are resolved to IPv4 here because llm-d's file discovery
    accepts only literal IPv4 addresses. Names default to ``vllm-<i>`` (``<role>-<i>``
    with a role); they are what the scorer hashes for group affinity, so keep them stable.
    """
    out: list[Endpoint] = []
    for spec in specs:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, hostport = item.rpartition("=")
            host, sep, port = hostport.rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"endpoint {item!r}: expected [name=]host:port")
            try:
                addr = str(ipaddress.IPv4Address(host))
            except ValueError:
                addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
            out.append(Endpoint(name or f"{role or 'vllm'}-{len(out)}", addr, int(port), role))
    if not out:
        raise ValueError("no endpoints given")
    return _unique_names(out)


def _unique_names(endpoints: list[Endpoint]) -> list[Endpoint]:
    """`endpoints`, or ValueError when two share a name (the scorer tells replicas apart by name)."""
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate endpoint names: {names}")
    return endpoints


def build_endpoints_file(endpoints: Sequence[Endpoint], engine: str = "vllm") -> dict:
    """The document read by llm-d's ``file-discovery`` plugin."""
    return {
        "endpoints": [
            {"name": e.name, "address": e.address, "port": str(e.port),
             "labels": {ENGINE_LABEL: engine, **({ROLE_LABEL: e.role} if e.role else {})}}
            for e in endpoints
        ]
    }


@dataclass(frozen=True)
class KvEvents:
    """Prefix matching from the replicas' own KV-cache events instead of llm-d's approximation.

    The picker binds ``endpoint`` (a ZMQ SUB socket; keep it on loopback or a private
    network) and every replica publishes to it (:func:`vllm_kv_events_config`). Its
    ``precise-prefix-cache-producer`` indexes the blocks each replica reports, keyed by
    the replica's ``address:port`` carried in the event topic, and ``moerl-rl-scorer``
    reads its match (cached blocks over the prompt's complete blocks).
    """

    endpoint: str = "tcp://127.0.0.1:5557"
    block_size_tokens: int = 32  # the replicas' --block-size (moerl's replicas use 32)


@dataclass(frozen=True)
class Disagg:
    """llm-d's prefill/decode scheduling (see the module doc)."""

    # llm-d's prefix-based-pd-decider: prefill on a prefill replica when at least this many prompt
    # tokens are not cached on the decode pick (a turn whose history the decode replica holds
    # computes its few new tokens itself)
    non_cached_tokens: int = 64


def vllm_kv_events_config(events: KvEvents, replica: Endpoint, model: str) -> dict:
    """vLLM's ``--kv-events-config`` for `replica`: publish to the picker, topic ``kv@<address:port>@<model>``.

    A concrete ``tcp://host:port`` makes vLLM's publisher connect, so replicas never listen for it."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events.endpoint,
            "topic": f"kv@{replica.address}:{replica.port}@{model}"}


def build_epp_config(
    endpoints_path: str,
    params: ScorerParams = ScorerParams(),
    *,
    block_size_tokens: int = 64,
    watch_file: bool = True,
    policy_version_metric: str = POLICY_VERSION_METRIC,
    updating_metric: str = UPDATING_METRIC,
    affinity_headers: Sequence[str] = (AFFINITY_HEADER,),
    kv_events: KvEvents | None = None,
    disagg: Disagg | None = None,
) -> dict:
    """The ``EndpointPickerConfig`` (llm-d.ai/v1alpha1) as a plain dict."""
    prefix_plugins = _prefix_plugins(block_size_tokens, kv_events)
    scorer_params = params.to_plugin_parameters() | {
        "prefixMatchInfoProducerName": prefix_plugins[-1]["name"],
        "policyVersionAttribute": POLICY_VERSION_ATTRIBUTE,
        "updatingAttribute": UPDATING_ATTRIBUTE,
        "affinityHeaders": list(affinity_headers),
    }
    plugins = [
        _metrics_extractor([
            {"attributeKey": POLICY_VERSION_ATTRIBUTE, "metricSpec": policy_version_metric},
            {"attributeKey": UPDATING_ATTRIBUTE, "metricSpec": updating_metric},
        ]),
        *prefix_plugins,
        {"name": "paused-filter", "type": "moerl-paused-filter", "parameters": {"updatingAttribute": UPDATING_ATTRIBUTE}},
        {"name": "rl-scorer", "type": "moerl-rl-scorer", "parameters": scorer_params},
    ]
    profile = [{"pluginRef": "paused-filter"}, {"pluginRef": "rl-scorer", "weight": 1}]
    if disagg is None:
        return _config(endpoints_path, watch_file, plugins, {"default": profile})
    plugins += [
        {"name": "prefill-filter", "type": "prefill-filter"},
        {"name": "decode-filter", "type": "decode-filter"},
        {"name": "pd-decider", "type": "prefix-based-pd-decider",
         "parameters": {"nonCachedTokens": disagg.non_cached_tokens}},
    ]
    handler = {"name": "profile-handler", "type": "disagg-profile-handler",
               "parameters": {"profiles": {"decode": "decode", "prefill": "prefill"},
                              "deciders": {"prefill": "pd-decider"}}}
    return _config(endpoints_path, watch_file, plugins, {"decode": [{"pluginRef": "decode-filter"}, *profile],
                                                         "prefill": [{"pluginRef": "prefill-filter"}, *profile]},
                   handler)


def build_llmd_default_config(endpoints_path: str, *, block_size_tokens: int = 64, watch_file: bool = True) -> dict:
    """llm-d v0.10's own default profile (its loader's defaults and Helm chart): ``queue-scorer``
    (weight 2), ``kv-cache-utilization-scorer`` (2) and ``prefix-cache-scorer`` (3) on the
    approximate prefix producer; no moerl plugin. The baseline an operator gets without moerl."""
    return _config(endpoints_path, watch_file, [
        _metrics_extractor([]),
        *_prefix_plugins(block_size_tokens, None),
        {"name": "queue-scorer", "type": "queue-scorer"},
        {"name": "kv-cache-utilization-scorer", "type": "kv-cache-utilization-scorer"},
        {"name": "prefix-cache-scorer", "type": "prefix-cache-scorer",
         "parameters": {"prefixMatchInfoProducerName": "prefix-producer"}},
    ], {"default": [{"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3}]})


def _metrics_extractor(custom_metrics: list[dict]) -> dict:
    """llm-d's core metrics extractor over vLLM's standard metrics, plus `custom_metrics` as attributes."""
    engine = {
        "name": "vllm",
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:kv_cache_usage_perc",
        "loraSpec": "vllm:lora_requests_info",
        "cacheInfoSpec": "vllm:cache_config_info",
    }
    if custom_metrics:
        engine["customMetrics"] = custom_metrics
    return {"name": "metrics-extractor", "type": "core-metrics-extractor", "parameters": {"engineConfigs": [engine]}}


def _config(endpoints_path: str, watch_file: bool, plugins: list[dict], profiles: dict[str, list[dict]],
            handler: dict | None = None) -> dict:
    """An EndpointPickerConfig: file discovery, one metrics source, `plugins`, and each of `profiles`
    (name -> its filters and scorers) then the max-score picker, chosen by `handler` (by default
    llm-d's single-profile-handler)."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"name": "file-discovery", "type": "file-discovery",
             "parameters": {"path": endpoints_path, "watchFile": watch_file}},
            {"name": "metrics-source", "type": "metrics-data-source"},
            *plugins,
            {"name": "picker", "type": "max-score-picker"},
            handler or {"name": "profile-handler", "type": "single-profile-handler"},
        ],
        "schedulingProfiles": [{"name": name, "plugins": [*profile, {"pluginRef": "picker"}]}
                               for name, profile in profiles.items()],
        "dataLayer": {
            # our source/extractor replace llm-d's default pair (which lacks
            # the RL custom metrics); without this llm-d adds a second scraper
            "injectDefaults": False,
            "discovery": {"pluginRef": "file-discovery"},
            "sources": [{"pluginRef": "metrics-source", "extractors": [{"pluginRef": "metrics-extractor"}]}],
        },
    }


@dataclass(frozen=True)
class EppPorts:
    """The picker's three listening ports (llm-d's defaults)."""

    grpc: int = 9002
    health: int = 9003
    metrics: int = 9090


def epp_command(config_path: Path | str, *, binary: str = "moerl-epp", pool_name: str = "moerl",
                pool_namespace: str = "default", ports: EppPorts = EppPorts()) -> list[str]:
    """The command line that starts the picker in standalone mode on `config_path` (see the module doc)."""
    return [
        binary, "--config-file", str(config_path), "--pool-name", pool_name, "--pool-namespace", pool_namespace,
        "--secure-serving=false", "--grpc-port", str(ports.grpc), "--grpc-health-port", str(ports.health),
        "--metrics-port", str(ports.metrics), "--enable-pprof=false", "--allow-experimental-plugins",
        # llm-d's default exporter prints every span to stdout: on a busy host that is CPU the replicas need
        "--tracing=false",
    ]


def _prefix_plugins(block_size_tokens: int, kv_events: KvEvents | None) -> list[dict]:
    """The prefix-match producers; the last one feeds the scorer."""
    # moerl sends token ids; the default `estimate` backend passes them through unchanged
    token_producer = {"name": "token-producer", "type": "token-producer"}
    if kv_events is None:
        return [token_producer, {"name": "prefix-producer", "type": "approx-prefix-cache-producer",
                                 "parameters": {"blockSizeTokens": block_size_tokens, "autoTune": False}}]
    return [token_producer, {"name": "precise-prefix", "type": "precise-prefix-cache-producer", "parameters": {
        "tokenProcessorConfig": {"blockSizeTokens": kv_events.block_size_tokens},
        # the index's admissions, lookups and hits on the picker's /metrics
        "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
        "kvEventsConfig": {"zmqEndpoint": kv_events.endpoint, "topicFilter": "kv@", "discoverPods": False},
    }}]


def _scalar(v) -> str:
    # JSON scalars are valid YAML flow scalars; strings are always quoted so
    # names like "on" or "8000" keep their type.
    return json.dumps(v)


def to_yaml(obj, indent: int = 0) -> str:
    """Minimal block-style YAML for dicts/lists of JSON scalars."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines.append(to_yaml(v, indent + 2))
            else:
                lines.append(f"{pad}{k}: {_scalar(v) if not isinstance(v, (dict, list)) else json.dumps(v)}")
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 2)
                lines.append(f"{pad}- {body.lstrip()}")
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(obj))
    return "\n".join(lines)


def write(
    endpoints: Sequence[Endpoint], out_dir: Path, params: ScorerParams = ScorerParams(), *, llmd_default: bool = False,
    **kw,
) -> tuple[Path, Path]:
    """Write both files; returns (config path, endpoints path). `llmd_default`: llm-d's own default
    profile (`build_llmd_default_config`, which takes `block_size_tokens` and `watch_file` of `kw`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ep_path = (out_dir / "endpoints.yaml").resolve()
    cfg_path = out_dir / "epp-config.yaml"
    ep_path.write_text(to_yaml(build_endpoints_file(endpoints)) + "\n")
    cfg = build_llmd_default_config(str(ep_path), **kw) if llmd_default else build_epp_config(str(ep_path), params, **kw)
    cfg_path.write_text(to_yaml(cfg) + "\n")
    return cfg_path, ep_path


def main(argv: Sequence[str] | None = None) -> int:
    """CLI body of ``moerl router-config``."""
    ap = argparse.ArgumentParser(prog="moerl router-config", description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", action="append", required=True,
                    help="[name=]host:port, comma separated or repeated (the decode replicas with --prefill-endpoints)")
    ap.add_argument("--prefill-endpoints", action="append", default=[],
                    help="[name=]host:port of prefill replicas: llm-d's prefill/decode profiles (see above)")
    ap.add_argument("--pd-non-cached-tokens", type=int, default=Disagg.non_cached_tokens,
                    help="with --prefill-endpoints: prefill elsewhere when at least this many prompt tokens are "
                         "not cached on the decode replica")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--scorer-params", default="{}",
                    help="JSON moerl-rl-scorer parameters, e.g. '{\"weights\": {\"prefix\": 4}}'")
    ap.add_argument("--block-size-tokens", type=int, default=64)
    ap.add_argument("--policy-version-metric", default=POLICY_VERSION_METRIC)
    ap.add_argument("--updating-metric", default=UPDATING_METRIC)
    ap.add_argument("--no-watch", action="store_true", help="do not reload endpoints.yaml on change")
    ap.add_argument("--pool-namespace", default="default", help="the picker's --pool-namespace in the printed command")
    ap.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                    help="score prefixes from the replicas' KV-cache events, received on this ZMQ address "
                         "(llm-d's precise-prefix-cache-producer, read by moerl-rl-scorer); prints each replica's "
                         "vLLM --kv-events-config")
    ap.add_argument("--model", help="with --kv-events: the served model name the replicas' requests carry")
    args = ap.parse_args(argv)
    params = ScorerParams.from_plugin_parameters(json.loads(args.scorer_params))
    if args.kv_events and not args.model:
        ap.error("--kv-events needs --model (the served model name: it is part of each replica's event topic)")
    events = KvEvents(args.kv_events) if args.kv_events else None
    try:
        prefill = parse_endpoints(args.prefill_endpoints, "prefill") if args.prefill_endpoints else []
        endpoints = _unique_names(parse_endpoints(args.endpoints, "decode" if prefill else "") + prefill)
    except ValueError as e:
        ap.error(str(e))
    disagg = Disagg(args.pd_non_cached_tokens) if prefill else None
    cfg, eps = write(
        endpoints, args.out, params,
        block_size_tokens=args.block_size_tokens, watch_file=not args.no_watch,
        policy_version_metric=args.policy_version_metric, updating_metric=args.updating_metric, kv_events=events,
        disagg=disagg,
    )
    print(f"wrote {cfg.resolve()} and {eps}")
    print("start the picker (router_ext/epp/picker/README.md builds moerl-epp):")
    print("  " + " ".join(shlex.quote(a) for a in epp_command(cfg.resolve(), pool_namespace=args.pool_namespace)))
    print("its ports listen on every interface (llm-d has no bind-address flag): keep them off other hosts' reach")
    for e in endpoints if events else ():
        print(f"replica {e.name}: vllm ... --kv-events-config "
              + shlex.quote(json.dumps(vllm_kv_events_config(events, e, args.model))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
