"""The P -> D KV handover: how a prompt's KV gets from a prefill node to a decode node.

- :mod:`.messages`: what P and D say to each other (match prefix, push / stream / commit KV).
- P's side: :mod:`.lease` (the prefix query and D's lease), :mod:`.sender` (the
  :class:`KVSender` interface every path implements), one module per path: :mod:`.push` (whole,
  after the first token), :mod:`.stream` (layer by layer during the prefill), :mod:`.direct`
  (written in place into D's pools on this host); :mod:`.choose` picks one per request, and
  :mod:`.layer_capture` feeds the layer-wise ones from the forward.
- D's side: :mod:`.reservations` (pinned hits, leased slots, commit into the batch) and
  :mod:`.receiver` (answers the messages, scatters what arrives).
- :mod:`.loopback`: P and D in one process, no sockets (tests; :mod:`.rehearsal` before serving).

The bytes moved are (n_blocks - hit_blocks) x bytes per block (in place: the missing tokens'
bytes), and every lease ends: committed, released, or expired on D.
"""

from pd_cluster.handover.choose import SendOptions, choose_sender
from pd_cluster.handover.errors import HandoverFailed
from pd_cluster.handover.lease import DecodeLease, reserve
from pd_cluster.handover.loopback import LoopbackChannels, LoopbackLink
from pd_cluster.handover.receiver import DISCONNECT_GRACE_S, DecodeCounters, KVReceiver
from pd_cluster.handover.rehearsal import rehearse_handover
from pd_cluster.handover.reservations import NoCapacity, Reservation, Reservations
from pd_cluster.handover.sender import ChannelSource, Handed, KVSender, LayerSink

__all__ = [
    "DISCONNECT_GRACE_S",
    "ChannelSource",
    "DecodeCounters",
    "DecodeLease",
    "Handed",
    "HandoverFailed",
    "KVReceiver",
    "KVSender",
    "LayerSink",
    "LoopbackChannels",
    "LoopbackLink",
    "NoCapacity",
    "Reservation",
    "Reservations",
    "SendOptions",
    "choose_sender",
    "rehearse_handover",
    "reserve",
]
