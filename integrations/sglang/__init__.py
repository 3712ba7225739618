"""SGLang 0.5.9-0.5.23: the instrumentor and its one target table (docs/sglang.md).
A row names its shm-mode glue, its observe-mode glue (None: SGLang's code runs)
and the hop timer of both modes. The hooks, by process (file: what mmshm does):

tokenizer: ``wrap_shm_features`` (requests: tensors -> handles in a new request;
  pd: a decode instance's pixels withheld; timing: ``tokenizer_wrap``);
  ``_send_one_request`` (requests: the references travel with the message;
  ``tokenizer_send``); ``_handle_batch_request`` (requests: one fan-out per
  ``n > 1``); ``hash_feature`` (requests: the carried hash); ``__init__`` (roles).
data-parallel controller: ``__init__`` (roles: references back once forwarded).
scheduler, every TP rank: ``__init__`` (roles); ``recv_requests`` (requests:
  unwrap at TP 1, pd: withheld pixels settled; ``scheduler_recv``);
  ``broadcast_pyobj``, ``attn_cp_tp_broadcast_pyobj`` (0.5.23) (workers:
  deferred unwrap; ``broadcast_src/dst``); ``unwrap_shm_features``,
  ``_finalize_shm_features``, ``_get_multimodal_inputs`` (timing only:
  ``materialize``, ``mm_inputs``).
EPD (0.5.23, epd, on :mod:`mmshm.transport.handoff`): encoder ``MMEncoder._send``
  (a handle per proven TP rank, one segment), ``ZmqDelivery.release`` (the
  encoder's reference goes), ``MMEncoder.__init__`` (roles); language scheduler
  ``WaitingZmqRequest._extract_embedding_from_buffer`` (zero-copy map),
  ``MMReceiverBase._drain_scheduler_embeddings`` and
  ``WaitingMMRequestBase._try_recv_mm_data`` (unread handles given back),
  ``MMReceiverBase._process_waiting_requests`` (a failed encode fails its
  request only), ``MMReceiverBase.__init__`` (roles: the rank's card, the
  handshake); language tokenizer
  ``MMReceiverBase._send_encode_request`` (no encoder: counted). 0.5.9-0.5.15:
  the encoder classes' ``__init__`` say the path is off.
"""

from mmshm.hooks import observe
from mmshm.hooks.instrumentor import SHM, Instrumentor, Target, source_file

from . import epd, requests, roles, timing, workers
from .server import (DP_CONTROLLER, ENCODER_RECEIVER, ENCODER_SERVER, MM_UTILS,
                     OLD_ENCODE_RECEIVER, OLD_ENCODE_SERVER, RECEIVER, SCHEDULER, SERVER,
                     TOKENIZER)


class SGLangInstrumentor(Instrumentor):
    """mmshm's instrumentor for SGLang."""

    name = package = SERVER
    title = "SGLang"
    supported = ">=0.5.9,<=0.5.23"

    def on_uninstrument(self) -> None:
        """Take the per-hop timing taps off (pyzmq, torch.distributed)."""
        observe.remove_taps()

    def targets(self) -> list[Target]:
        # 0.5.15 moved the scheduler's receive path into request_receiver
        receiver = source_file(RECEIVER) is not None
        sched, cls = (RECEIVER, "SchedulerRequestReceiver") if receiver else \
            (SCHEDULER, "Scheduler")
        return [
            Target(MM_UTILS, "_get_is_default_transport"),
            Target(MM_UTILS, "wrap_shm_features", requests.wrap_shm_features, None,
                   timing.TOKENIZER_WRAP),
            Target(TOKENIZER, "wrap_shm_features", requests.wrap_shm_features, None,
                   timing.TOKENIZER_WRAP),
            Target(TOKENIZER, "TokenizerManager._send_one_request", requests.send_one_request,
                   None, timing.TOKENIZER_SEND),
            Target(TOKENIZER, "TokenizerManager.__init__", roles.tokenizer_ready, optional=True),
            Target(SCHEDULER, "Scheduler.__init__", roles.scheduler_ready, optional=True),
            Target(sched, "broadcast_pyobj", workers.deferred_broadcast, None, timing.BROADCAST,
                   factory=True),
            Target(sched, f"{cls}.recv_requests", requests.recv_requests, None,
                   timing.SCHEDULER_RECV),
            Target(sched, "unwrap_shm_features", hop=timing.UNWRAP, optional=True),
            Target(sched, f"{cls}._finalize_shm_features", hop=timing.FINALIZE, optional=True),
            Target(SCHEDULER, "Scheduler._get_multimodal_inputs", hop=timing.MM_INPUTS,
                   optional=True),
            Target(MM_UTILS, "hash_feature", requests.hash_feature, only=SHM),
            Target(TOKENIZER, "TokenizerManager._handle_batch_request",
                   requests.handle_batch_request, only=SHM),
            Target(DP_CONTROLLER, "DataParallelController.__init__", roles.controller_ready,
                   optional=True, only=SHM),
        ] + ([Target(RECEIVER, "attn_cp_tp_broadcast_pyobj", workers.attn_broadcast,
                     optional=True, factory=True, only=SHM)] if receiver else []) + \
            self.epd_targets()

    @staticmethod
    def epd_targets() -> list[Target]:
        """Encoder disaggregation (``--encoder-only`` / ``--language-only``): all
        optional, so a release without this code refuses nothing."""
        enc, recv = ENCODER_SERVER, ENCODER_RECEIVER
        return [
            Target(enc, "MMEncoder._send", epd.encoder_send, optional=True, only=SHM),
            Target(enc, "ZmqDelivery.release", epd.delivery_release, optional=True,
                   only=SHM),
            Target(enc, "MMEncoder.__init__", roles.encoder_ready, optional=True, only=SHM),
            Target(recv, "WaitingZmqRequest._extract_embedding_from_buffer",
                   epd.extract_embedding, optional=True, only=SHM),
            Target(recv, "MMReceiverBase._drain_scheduler_embeddings",
                   epd.drain_embeddings, optional=True, only=SHM),
            Target(recv, "WaitingMMRequestBase._try_recv_mm_data", epd.try_recv,
                   optional=True, only=SHM),
            Target(recv, "MMReceiverBase.__init__", roles.epd_receiver_ready, optional=True,
                   only=SHM),
            # a failed encode fails its request only, in both modes
            Target(recv, "MMReceiverBase._process_waiting_requests", epd.process_waiting,
                   optional=True),
            Target(recv, "MMReceiverBase._send_encode_request", epd.send_encode_request,
                   optional=True),
            Target(OLD_ENCODE_SERVER, "MMEncoder.__init__",
                   roles.epd_unrecognized("encoder", epd.PATH_EPD_SEND), optional=True,
                   only=SHM),
            Target(OLD_ENCODE_RECEIVER, "MMReceiverBase.__init__",
                   roles.epd_unrecognized("encoder receiver", epd.PATH_EPD_RECV),
                   optional=True, only=SHM),
        ]
