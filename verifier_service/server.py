"""gRPC adapter of the verifier: validate, call the engine, map the result."""

from __future__ import annotations

from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import SessionMethods, load_to_pb, proposal_from_pb, rpc_method, run_until_signal, sampling_from_pb, serve
from specdec_rpc.ops import caller_owner
from verifier_service.engine import VerifierEngine


class VerifierServicer(SessionMethods, pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine) -> None:
        self.engine = engine

    @rpc_method
    def Verify(self, request, context):
        out = self.engine.verify(
            request.session_id,
            request.truncate_to,
            list(request.append_token_ids),
            list(request.draft_token_ids),
            proposal_from_pb(request.proposal, request.HasField("proposal")),
            sampling_from_pb(request.sampling),
            prompt_length=request.prompt_length,
            owner=caller_owner(context),  # someone else's session is NOT_FOUND
        )
        return pb.VerifyResponse(
            output_token_ids=out.output_token_ids, num_accepted=out.num_accepted, kv_length=out.kv_length,
            logprobs=[pb.TokenLogprobs(logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids,
                                       top_logprobs=lp.top_logprobs) for lp in out.logprobs or []],
            load=load_to_pb(out.load),
        )


def start(engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0, **kwargs):
    return serve(engine, lambda s: pb_grpc.add_VerifierServicer_to_server(VerifierServicer(engine), s), host, port, **kwargs)


def run(engine: VerifierEngine, host: str, port: int, grace_s: float = 5.0, **serve_kwargs) -> None:
    """Serve until SIGINT / SIGTERM (prints the bound address first); serve_kwargs: TLS,
    auth and metrics options of adapters.serve."""
    server, _ = start(engine, host, port, **serve_kwargs)
    run_until_signal(server, grace_s)
    engine.shutdown()
