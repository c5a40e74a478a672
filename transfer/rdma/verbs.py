"""The real verbs backend over pyverbs. Importing this module imports pyverbs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from transfer.rdma.logic import (
    LocalSegment,
    QpInfo,
    WritePlan,
    pick_device,
    rtr_attributes,
    rts_attributes,
)

_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


class _Completion:
    __slots__ = ("byte_len", "imm", "status", "wr_id")

    def __init__(self, wr_id: int, status: int, imm: int | None, byte_len: int) -> None:
        self.wr_id, self.status, self.imm, self.byte_len = wr_id, status, imm, byte_len


class PyverbsBackend:
    """`VerbsBackend` on the first (or the named) RDMA device, port 1."""

    def __init__(self, device_name: str = "", port: int = 1, gid_index: int = 0, max_sge: int = 16,
                 queue_depth: int = 512) -> None:
        import pyverbs.device as device
        import pyverbs.enums as enums
        from pyverbs.cq import CQ
        from pyverbs.pd import PD

        try:
            devices = device.get_device_list()
        except Exception:  # no rdma-core provider or no device: pick_device gives the clear error
            devices = []
        chosen = pick_device(devices, device_name)
        name = chosen.name.decode() if isinstance(chosen.name, bytes) else str(chosen.name)
        self._enums = enums
        self.context = device.Context(name=name)
        self.pd = PD(self.context)
        self.cq = CQ(self.context, queue_depth * 4)
        self.port, self.gid_index, self.max_sge, self.queue_depth = port, gid_index, max_sge, queue_depth
        self._mrs: dict[int, Any] = {}

    def register(self, addr: int, nbytes: int) -> tuple[int, int]:
        from pyverbs.mr import MR

        e = self._enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        mr = MR(self.pd, max(nbytes, 1), access, address=addr)
        self._mrs[mr.lkey] = mr
        return mr.lkey, mr.rkey

    def deregister(self, lkey: int) -> None:
        mr = self._mrs.pop(lkey, None)
        if mr is not None:
            mr.close()

    def create_qp(self) -> Any:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=self.queue_depth, max_recv_wr=self.queue_depth,
                    max_send_sge=self.max_sge, max_recv_sge=1)
        init = QPInitAttr(qp_type=self._enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        return QP(self.pd, init)

    def local_info(self, qp: Any, layout: str) -> QpInfo:
        port = self.context.query_port(self.port)
        gid = self.context.query_gid(self.port, self.gid_index)
        return QpInfo(qp.qp_num, random.randrange(1 << 24), port.lid, str(gid), int(port.active_mtu), layout)

    def connect(self, qp: Any, remote: QpInfo) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        mtu = int(self.context.query_port(self.port).active_mtu)
        rtr = rtr_attributes(remote, self.port, self.gid_index, mtu)
        attr = QPAttr(qp_state=self._enums.IBV_QPS_INIT, cur_qp_state=self._enums.IBV_QPS_RESET)
        attr.port_num = self.port
        attr.qp_access_flags = (self._enums.IBV_ACCESS_REMOTE_WRITE | self._enums.IBV_ACCESS_LOCAL_WRITE)
        qp.to_init(attr)
        for field in ("path_mtu", "dest_qp_num", "rq_psn", "max_dest_rd_atomic", "min_rnr_timer"):
            setattr(attr, field, rtr[field])
        route = None
        if rtr["ah_is_global"]:
            route = GlobalRoute(dgid=GID(rtr["ah_dgid"]), sgid_index=rtr["ah_sgid_index"])
        attr.ah_attr = AHAttr(port_num=rtr["ah_port_num"], dlid=rtr["ah_dlid"],
                              is_global=int(rtr["ah_is_global"]), gr=route)
        qp.to_rtr(attr)
        for field, value in rts_attributes(random.randrange(1 << 24)).items():
            setattr(attr, field, value)
        qp.to_rts(attr)

    def _sges(self, sges: Sequence[LocalSegment]) -> list[Any]:
        from pyverbs.wr import SGE

        return [SGE(s.addr, s.length, s.lkey) for s in sges]

    def post_recv(self, qp: Any, wr_id: int, sges: Sequence[LocalSegment]) -> None:
        from pyverbs.wr import RecvWR

        qp.post_recv(RecvWR(wr_id=wr_id, num_sge=len(sges), sg=self._sges(sges)))

    def post_send(self, qp: Any, wr_id: int, sges: Sequence[LocalSegment]) -> None:
        from pyverbs.wr import SendWR

        e = self._enums
        qp.post_send(SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=len(sges), sg=self._sges(sges),
                            send_flags=e.IBV_SEND_SIGNALED))

    def post_write(self, qp: Any, wr_id: int, write: WritePlan, imm: int | None, signaled: bool) -> None:
        from pyverbs.wr import SendWR

        e = self._enums
        opcode = e.IBV_WR_RDMA_WRITE if imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM
        flags = e.IBV_SEND_SIGNALED if signaled else 0
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(write.sges), sg=self._sges(write.sges) or None,
                    send_flags=flags, imm_data=imm or 0)
        wr.set_wr_rdma(write.rkey, write.remote_addr)
        qp.post_send(wr)

    def poll(self, max_entries: int) -> list[Any]:
        count, wcs = self.cq.poll(max_entries)
        e = self._enums
        completions = []
        for wc in wcs[:count]:
            imm = wc.imm_data if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM else None
            completions.append(_Completion(wc.wr_id, wc.status, imm, wc.byte_len))
        return completions

    def error_qp(self, qp: Any) -> None:
        from pyverbs.qp import QPAttr

        qp.modify(QPAttr(qp_state=self._enums.IBV_QPS_ERR), self._enums.IBV_QP_STATE)

    def close(self) -> None:
        for lkey in list(self._mrs):
            self.deregister(lkey)
        self.cq.close()
        self.pd.close()
        self.context.close()

    @staticmethod
    def mtu_bytes(mtu: int) -> int:
        """Bytes of an `ibv_mtu` enum value."""
        return _MTU_BYTES.get(mtu, 0)
