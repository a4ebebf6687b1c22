"""The stage data plane schema: committed modules are what the generator makes of it."""

import pytest

from skippy.proto.generate import PROTO_DIR, generate, rewrite_imports


def test_committed_modules_are_what_the_generator_writes(tmp_path):
    pytest.importorskip("grpc_tools")  # a test extra
    written = generate(tmp_path)
    assert {p.name for p in written} >= {"stage_pb2.py", "stage_pb2.pyi", "stage_pb2_grpc.py"}
    for fresh in written:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed: run `make proto`"
        assert committed.read_bytes() == fresh.read_bytes(), \
            f"{fresh.name} differs from its schema: run `make proto`"


def test_sibling_imports_point_into_the_package():
    assert rewrite_imports("import stage_pb2 as stage__pb2\n") == \
        "from skippy.proto import stage_pb2 as stage__pb2\n"
    assert rewrite_imports("from google.protobuf import message\n") == \
        "from google.protobuf import message\n"


def test_generated_modules_import_under_skippy_proto():
    from skippy.proto import stage_pb2, stage_pb2_grpc
    assert stage_pb2.DESCRIPTOR.package == "skippy.v1"
    assert stage_pb2_grpc.stage__pb2 is stage_pb2


def test_a_stage_call_round_trips():
    from skippy.proto import stage_pb2
    frame = stage_pb2.Frame(dtype=stage_pb2.Frame.Q8, start=7, rows=2, width=3,
                            data=bytes(range(6)), scales=b"\x00\x00\x80?" * 2)
    call = stage_pb2.StageCall(prefill=stage_pb2.Prefill(
        tokens=[1, 2, 3], start=1, frame=frame, namespace="t",
        sampling=stage_pb2.Sampling(temperature=0.5, seed=42)))
    back = stage_pb2.StageCall.FromString(call.SerializeToString())
    assert back == call
    assert back.WhichOneof("call") == "prefill"
    assert back.prefill.frame.dtype == stage_pb2.Frame.Q8
    assert back.prefill.sampling.HasField("seed")


def test_stage_service_has_a_stub_and_a_servicer():
    import grpc

    from skippy.proto import stage_pb2_grpc
    servicer = stage_pb2_grpc.StageServicer()
    assert callable(servicer.Session) and callable(servicer.GetBlocks)
    assert callable(stage_pb2_grpc.add_StageServicer_to_server)
    with grpc.insecure_channel("localhost:1") as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        assert callable(stub.Session) and callable(stub.GetBlocks)
