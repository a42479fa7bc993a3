"""`mtpserve bench`: serving benchmarks, one module per concept.

    cli               the `mtpserve bench` parser, dispatch and the results file (JSON + PNG)
    workload          prompts and arrivals: bundled, random or a file; closed loop or Poisson
    engine_driver     the engine in process, one per draft count, at every load
    http_driver       streaming completions against any OpenAI-compatible server (--url)
    report            figures (DESIGN §8), machine info, the table and the plot
    anchor            onnxruntime-genai's og.Engine in a child process (--compare ortgenai)
    replicas          the Serve app at 1..N replicas over HTTP (--replicas)
    fault             a replica killed mid-load (--replicas N --kill-replica-after S)
    serving_overhead  HTTP vs in-process TTFT and inter-token latency (--serving-overhead)

Deploying the app is ``mtpserve.cluster.deploy``; the random-weight models the bench can make
(--make-model) are ``mtpserve.cluster.checkpoints``.
"""
