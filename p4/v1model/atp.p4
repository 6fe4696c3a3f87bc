// ATP switch data plane for BMv2 simple_switch (v1model), P4_16.
// A step-by-step mirror of atp_pipeline/ina/switch.py:process (ATP §5.3, Figure 4 ①-⑩),
// two-level, multi-tenant. Values per packet: ATP_K (62) int32 lanes, no recirculation.
// Registers (Figure 3): agg_key (valid ++ job ++ seq, 49 bit), agg_shard, agg_bitmap,
// agg_count, agg_flags, ATP_K lane registers (generated), wm (per <job, shard> watermark).
// The watermark sweep of switch.py (a parameter packet that raises <job, shard>'s watermark
// frees that job's aggregators below it) is applied lazily: any packet that touches an
// aggregator whose sequence is below its own job's watermark for its shard finds it free.
// Every output equals the Python function's (an aggregator is stale exactly when the sweep
// freed it); only the register contents differ until the next touch.
// The ⑦ flush uses an ingress-to-egress clone (session ATP_FLUSH_SESSION, egress port set
// by the control plane to the uplink toward the PS). ECN marking happens in egress.
// Aggregator index: CRC32(job, seq) & (ATP_N_AGG - 1), ATP_N_AGG a power of two (switch.agg_slot).
// Counters: `stats` counts every packet under the name switch.SwitchStats gives it (indices
// generated), `job_allocs`/`job_complete`/`job_params` count per job (the live BMv2 switch
// reads them: the fraction of a job's sequences completed in the switch).
#include <core.p4>
#include <v1model.p4>
#include "../common/atp_common.p4"

const bit<32> ATP_FLUSH_SESSION = 32w1;
const bit<32> CLONE_I2E = 32w1;  // standard_metadata.instance_type of an I2E clone
#define ATP_KEY(job, seq) ((bit<49>)1 << 48 | (bit<49>)(job) << 32 | (bit<49>)(seq))

parser AtpParser(packet_in pkt, out headers_t hdr, inout atp_meta_t meta,
                 inout standard_metadata_t sm) {
    state start { pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) { ETHERTYPE_IPV4: ipv4; default: accept; } }
    state ipv4 { pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) { IPPROTO_UDP: udp; default: accept; } }
    state udp { pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) { ATP_UDP_PORT: atp; default: accept; } }
    state atp { pkt.extract(hdr.atp);
        // classifier: app type + zero padding, else not ATP: the ingress drops a frame whose
        // atp header is valid without atp_data (decode() rejects it too). BMv2 ignores an
        // explicit `reject` (p4c-bm2-ss warns), so the parser accepts and the ingress decides.
        transition select(hdr.atp.app_type, hdr.atp.reserved) { (ATP_APP_TYPE, 0): atp_data; default: accept; } }
    state atp_data { pkt.extract(hdr.atp_data); transition accept; }
}

control AtpVerifyChecksum(inout headers_t hdr, inout atp_meta_t meta) { apply { } }

control AtpIngress(inout headers_t hdr, inout atp_meta_t meta, inout standard_metadata_t sm) {
    register<bit<49>>(ATP_N_AGG) agg_key;
    register<bit<2>>(ATP_N_AGG) agg_shard;
    register<atp_bitmap_t>(ATP_N_AGG) agg_bitmap;
    register<atp_fan_t>(ATP_N_AGG) agg_count;
    register<bit<2>>(ATP_N_AGG) agg_flags;
    register<bit<32>>(262144) wm;  // index job ++ ps_index (18 bit)
    counter(ATP_N_STATS, CounterType.packets) stats;     // index ATP_STAT_* (switch.SwitchStats)
    counter(65536, CounterType.packets) job_allocs;      // per job: aggregator allocations
    counter(65536, CounterType.packets) job_complete;    // per job: ⑥ aggregates completed here
    counter(65536, CounterType.packets) job_params;      // per job: parameter packets (one per sequence)
#include "../generated/atp_lanes_v1model.p4"

    bit<49> k;
    bit<2> shard_i;
    bit<32> wm_i;
    atp_bitmap_t b;
    atp_fan_t cnt;
    bit<2> f;
    bool match;
    bool valid;

    action drop() { mark_to_drop(sm); meta.forward = 0; }
    action malformed() { mark_to_drop(sm); meta.forward = 0; stats.count(ATP_STAT_MALFORMED); }
    action complete() { stats.count(ATP_STAT_COMPLETE); job_complete.count((bit<32>)hdr.atp.job); }
    action set_port(bit<9> port) { sm.egress_spec = port; }
    action set_job(bit<16> grp) { meta.mcast_grp = grp; }
    table ipv4_route {  // plain forwarding: gradients toward the PS, and all non-ATP IPv4
        key = { hdr.ipv4.dst_addr: lpm; }
        actions = { set_port; drop; }
        default_action = drop();
    }
    table l2_forward {  // non-IPv4 frames (ARP, ...): forwarded untouched by destination MAC
        key = { hdr.ethernet.dst_addr: exact; }
        actions = { set_port; drop; }
        default_action = drop();
    }
    table atp_job {  // the job table of §5.1: jobs served here and their multicast group
        key = { hdr.atp.job: exact; }
        actions = { set_job; NoAction; }
        default_action = NoAction();
    }

    action agg_free() {  // ②/⑩ deallocation: every field of the aggregator to 0
        agg_key.write(meta.idx, 0); agg_shard.write(meta.idx, 0); agg_bitmap.write(meta.idx, 0);
        agg_count.write(meta.idx, 0); agg_flags.write(meta.idx, 0); lanes_clear();
    }
    action flip_level() { hdr.atp.edge = hdr.atp.edge ^ 1; }

    apply {
        meta.forward = 1;
        // v1model: a parser error does not drop; the packet arrives with parser_error set.
        // A frame to the ATP port that is not one well-formed ATP packet is dropped as the
        // Python decode() drops it (malformed): truncated (parser error), wrong app type or
        // reserved bits (atp without atp_data), or longer than one packet (UDP length).
        if (sm.parser_error != error.NoError) {
            if (hdr.udp.isValid() && hdr.udp.dst_port == ATP_UDP_PORT) { malformed(); } else { drop(); }
            return;
        }
        if (hdr.atp.isValid() && (!hdr.atp_data.isValid()
                                  || hdr.udp.length != 8 + ATP_HEADER_BYTES + ATP_PAYLOAD_BYTES)) {
            malformed(); return;
        }
        if (hdr.atp.isValid()) {
            if (!atp_job.apply().hit) { drop(); stats.count(ATP_STAT_UNKNOWN_JOB); return; }  // unknown job
            hash(meta.h, HashAlgorithm.crc32, 32w0, { hdr.atp.job, hdr.atp.seq }, 64w4294967296);
            meta.idx = meta.h & (ATP_N_AGG - 1);  // switch.agg_slot: ATP_N_AGG is a power of two
            agg_key.read(k, meta.idx);
            if (hdr.atp.is_param == 1) {
                // parameter packet: learn the shard watermark, ② deallocate, multicast
                stats.count(ATP_STAT_PARAM);
                job_params.count((bit<32>)hdr.atp.job);
                wm.read(meta.wm, (bit<32>)(hdr.atp.job ++ hdr.atp.ps_index));
                if (hdr.atp.watermark > meta.wm) { wm.write((bit<32>)(hdr.atp.job ++ hdr.atp.ps_index), hdr.atp.watermark); }
                if (k == ATP_KEY(hdr.atp.job, hdr.atp.seq)) {
                    agg_free();  // ②
                    stats.count(ATP_STAT_DEALLOC_PARAM);
                } else if (k[48:48] == 1) {
                    // the sweep, lazily: an aggregator of any job below that job's watermark
                    // for its shard is stale; switch.py freed it when the watermark passed it
                    agg_shard.read(shard_i, meta.idx);
                    wm.read(wm_i, (bit<32>)(k[47:32] ++ shard_i));
                    if (k[31:0] < wm_i) { agg_free(); stats.count(ATP_STAT_STALE_RECLAIMED); }
                }
                sm.mcast_grp = meta.mcast_grp;  // to the job's workers
                return;
            }
            // ③ the edge-switch identifier selects this level's fan-in and bitmap
            if (hdr.atp.edge == 0) { meta.fan_in = hdr.atp.fan_in0; meta.bm = hdr.atp.bitmap0; }
            else { meta.fan_in = hdr.atp.fan_in1; meta.bm = hdr.atp.bitmap1; }
            if (meta.fan_in == 0) {  // no aggregation service at this level (validate_gradient)
                if (hdr.atp.fan_in0 == 0 || hdr.atp.fan_in0 > ATP_BITMAP_BITS || hdr.atp.fan_in1 > ATP_BITMAP_BITS
                    || hdr.atp.bitmap0 == 0 || (hdr.atp.bitmap0 >> hdr.atp.fan_in0) != 0
                    || (hdr.atp.fan_in1 != 0 && (hdr.atp.bitmap1 == 0 || (hdr.atp.bitmap1 >> hdr.atp.fan_in1) != 0))) {
                    malformed(); return;
                }
                stats.count(ATP_STAT_NO_SERVICE);
            } else if (meta.fan_in > ATP_BITMAP_BITS || meta.bm == 0 || (meta.bm >> meta.fan_in) != 0
                       || (meta.bm & (meta.bm - 1)) != 0 || hdr.atp.fan_in1 > ATP_BITMAP_BITS
                       || (hdr.atp.edge == 1 && (hdr.atp.fan_in0 == 0 || hdr.atp.fan_in0 > ATP_BITMAP_BITS
                           || hdr.atp.bitmap0 == 0 || (hdr.atp.bitmap0 >> hdr.atp.fan_in0) != 0))) {
                malformed(); return;  // one child, inside the fan-in
            } else {
                wm.read(meta.wm, (bit<32>)(hdr.atp.job ++ hdr.atp.ps_index));
                if (hdr.atp.seq < meta.wm) {  // already complete: never allocate
                    hdr.atp.resend = 1; flip_level();
                    stats.count(ATP_STAT_STALE_FORWARD);
                } else {
                    hdr.atp.agg_index = meta.h;
                    match = k == ATP_KEY(hdr.atp.job, hdr.atp.seq);
                    valid = k[48:48] == 1;
                    if (valid && !match) {
                        // the sweep, lazily (as for parameter packets above): a stale
                        // aggregator of any job is free to this packet
                        agg_shard.read(shard_i, meta.idx);
                        wm.read(wm_i, (bit<32>)(k[47:32] ++ shard_i));
                        if (k[31:0] < wm_i) { agg_free(); valid = false; stats.count(ATP_STAT_STALE_RECLAIMED); }
                    }
                    agg_bitmap.read(b, meta.idx);
                    agg_flags.read(f, meta.idx);
                    if (hdr.atp.resend == 1) {
                        if (!match) {  // no aggregator of ours: upstream, never allocate
                            if (valid) { hdr.atp.collision = 1; }
                            flip_level();
                            stats.count(ATP_STAT_RESEND_FORWARD);
                        } else if (hdr.atp.edge == 1) {
                            // ⑦ second level: the clone (the packet as parsed) is the forwarded
                            // retransmission; this packet becomes the flush of the partial
                            // level-1 aggregate; then ⑩ deallocate
                            clone(CloneType.I2E, ATP_FLUSH_SESSION);
                            lanes_read();
                            hdr.atp.bitmap1 = b; hdr.atp.agg1 = 1;
                            hdr.atp.ecn = hdr.atp.ecn | f[0:0]; hdr.atp.overflow = hdr.atp.overflow | f[1:1];
                            hdr.atp.edge = 0;
                            agg_free();
                            stats.count(ATP_STAT_L1_FLUSH);
                        } else {
                            // first level: ④ merge a new bit (⑧ already set: no merge),
                            // ⑨ carry value + bitmap upstream, ⑩ deallocate
                            if ((b & meta.bm) == 0) {
                                lanes_add();
                                b = b | meta.bm;
                                f = f | (hdr.atp.overflow ++ hdr.atp.ecn);
                                stats.count(ATP_STAT_RESEND_MERGED);
                            } else {
                                lanes_read();
                            }
                            hdr.atp.bitmap0 = b;
                            hdr.atp.ecn = hdr.atp.ecn | f[0:0]; hdr.atp.overflow = hdr.atp.overflow | f[1:1];
                            hdr.atp.edge = 1;
                            agg_free();
                            stats.count(ATP_STAT_RESEND_FLUSH);
                        }
                    } else if (!valid) {
                        // allocation: claim with <job, seq>, value and bitmap
                        agg_key.write(meta.idx, ATP_KEY(hdr.atp.job, hdr.atp.seq));
                        agg_shard.write(meta.idx, hdr.atp.ps_index);
                        agg_bitmap.write(meta.idx, meta.bm);
                        agg_count.write(meta.idx, 1);
                        agg_flags.write(meta.idx, hdr.atp.overflow ++ hdr.atp.ecn);
                        lanes_write();
                        stats.count(ATP_STAT_ALLOC);
                        job_allocs.count((bit<32>)hdr.atp.job);
                        if (meta.fan_in > 1) { drop(); return; }
                        if (hdr.atp.edge == 1) { hdr.atp.agg1 = 1; }  // ⑥ complete at once
                        flip_level();
                        complete();
                    } else if (!match) {
                        // ① occupied by another <job, seq>: upstream untouched, resend, level flip
                        hdr.atp.resend = 1; hdr.atp.collision = 1; flip_level();
                        stats.count(ATP_STAT_COLLISION);
                    } else if ((b & meta.bm) != 0) {
                        drop(); stats.count(ATP_STAT_DUP_DROPPED); return;  // ④ already aggregated, not a retransmission
                    } else {
                        // ① matched: ④ aggregate value and bitmap, ⑤ count
                        lanes_add();
                        b = b | meta.bm;
                        agg_bitmap.write(meta.idx, b);
                        agg_count.read(cnt, meta.idx);
                        cnt = cnt + 1;
                        agg_count.write(meta.idx, cnt);
                        f = f | (hdr.atp.overflow ++ hdr.atp.ecn);
                        agg_flags.write(meta.idx, f);
                        stats.count(ATP_STAT_MERGED);
                        if (cnt < meta.fan_in) { drop(); return; }  // ⑥ not complete: consumed
                        // ⑥ complete: the packet carries the aggregate upstream (stays until ②)
                        if (hdr.atp.edge == 0) { hdr.atp.bitmap0 = b; } else { hdr.atp.bitmap1 = b; hdr.atp.agg1 = 1; }
                        hdr.atp.ecn = f[0:0]; hdr.atp.overflow = f[1:1];
                        flip_level();
                        complete();
                    }
                }
            }
        }
        if (meta.forward == 1 && hdr.ipv4.isValid()) { ipv4_route.apply(); }
        else if (!hdr.ipv4.isValid()) { l2_forward.apply(); }
    }
}

control AtpEgress(inout headers_t hdr, inout atp_meta_t meta, inout standard_metadata_t sm) {
    register<bit<19>>(1) ecn_threshold;  // queue depth (packets) above which ATP packets are marked
    bit<19> thr;
    apply {
        if (hdr.atp.isValid()) {
            if (sm.instance_type == CLONE_I2E) {  // ⑦ the forwarded retransmission
                hdr.atp.edge = 0;
                hash(hdr.atp.agg_index, HashAlgorithm.crc32, 32w0, { hdr.atp.job, hdr.atp.seq }, 64w4294967296);
            }
            ecn_threshold.read(thr, 0);
            if (sm.enq_qdepth > thr) { hdr.atp.ecn = 1; }  // switch.ecn_mark (§5.4)
        }
    }
}

control AtpComputeChecksum(inout headers_t hdr, inout atp_meta_t meta) { apply { } }  // L3/L4 unchanged

control AtpDeparser(packet_out pkt, in headers_t hdr) {
    apply { pkt.emit(hdr.ethernet); pkt.emit(hdr.ipv4); pkt.emit(hdr.udp); pkt.emit(hdr.atp); pkt.emit(hdr.atp_data); }
}

V1Switch(AtpParser(), AtpVerifyChecksum(), AtpIngress(), AtpEgress(), AtpComputeChecksum(), AtpDeparser()) main;
