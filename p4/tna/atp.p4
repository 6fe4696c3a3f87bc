// ATP switch data plane for Tofino (TNA), P4_16 — mirror of atp_pipeline/ina/switch.py:process
// (ATP §5.3, Figure 4 ①-⑩). UNVERIFIED: no Tofino compiler (bf-p4c) was available; see README.
// Tofino constraints: every register is touched by at most one RegisterAction per packet, so
// each Figure 3 field has one RegisterAction per mutually exclusive path. Values per packet:
// ATP_K = 62 lane registers in one pass; that needs ~62 stateful ALUs plus 4 for the key,
// bitmap, count and flags — more than Tofino-1's 48 (12 stages x 4), so K = 62 targets
// Tofino-2 (20 stages x 4 = 80); for Tofino-1 regenerate with a smaller K (<= 40) in the
// Python format. The ⑦ flush uses ingress mirroring to a recirculation port: the copy
// re-enters with agg1 = 1 and reads-and-clears the aggregator in a second pass.
// Divergences from the Python function (stated, not hidden): stale aggregators are not
// reclaimed on touch (a third comparison in the key SALU is not available); the control
// plane clears them at job teardown.
#include <core.p4>
#include <tna.p4>
#include "../common/atp_common.p4"

struct key_pair_t { bit<32> hi; bit<32> lo; }  // hi = 1 << 18 | shard << 16 | job, lo = seq; 0 = free
const bit<8> K_COLLIDE = 0;
const bit<8> K_MATCH = 1;
const bit<8> K_ALLOC = 2;

struct ig_meta_t { atp_meta_t atp; bit<32> key_hi; bit<8> kst; bit<1> flush_pass; MirrorId_t session; }
struct eg_meta_t { }

parser IgParser(packet_in pkt, out headers_t hdr, out ig_meta_t meta, out ingress_intrinsic_metadata_t ig_md) {
    state start {
        pkt.extract(ig_md); pkt.advance(PORT_METADATA_SIZE);
        // every metadata field starts at 0 (an `out` parameter is undefined until written)
        meta.atp = { 0, 0, 0, 0, 0, 0, 0 }; meta.key_hi = 0; meta.kst = 0; meta.flush_pass = 0; meta.session = 0;
        transition ethernet; }
    state ethernet { pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) { ETHERTYPE_IPV4: ipv4; default: accept; } }
    state ipv4 { pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) { IPPROTO_UDP: udp; default: accept; } }
    state udp { pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) { ATP_UDP_PORT: atp; default: accept; } }
    state atp { pkt.extract(hdr.atp); pkt.extract(hdr.atp_data); transition accept; }
}

control Ig(inout headers_t hdr, inout ig_meta_t meta, in ingress_intrinsic_metadata_t ig_md,
           in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
           inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
           inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    Hash<bit<32>>(HashAlgorithm_t.CRC32) crc;
    Register<key_pair_t, bit<32>>(ATP_N_AGG) agg_key;
    Register<atp_bitmap_t, bit<32>>(ATP_N_AGG, 0) agg_bitmap;
    Register<atp_fan_t, bit<32>>(ATP_N_AGG, 0) agg_count;
    Register<bit<8>, bit<32>>(ATP_N_AGG, 0) agg_flags;
    Register<bit<32>, bit<18>>(262144, 0) wm;
    // The generated lane code names the index meta.idx; alias it.
#define meta meta.atp
#include "../generated/atp_lanes_tna.p4"
#undef meta

    // key: ① compare / claim (allocation), ② and ⑩ free on match
    RegisterAction<key_pair_t, bit<32>, bit<8>>(agg_key) key_grad = { void apply(inout key_pair_t v, out bit<8> r) {
        if (v.hi == meta.key_hi && v.lo == hdr.atp.seq) { r = K_MATCH; }
        else if (v.hi == 0) { v.hi = meta.key_hi; v.lo = hdr.atp.seq; r = K_ALLOC; }
        else { r = K_COLLIDE; } } };
    RegisterAction<key_pair_t, bit<32>, bit<8>>(agg_key) key_free_on_match = { void apply(inout key_pair_t v, out bit<8> r) {
        if (v.hi == meta.key_hi && v.lo == hdr.atp.seq) { v.hi = 0; v.lo = 0; r = K_MATCH; }
        else if (v.hi == 0) { r = K_ALLOC; } else { r = K_COLLIDE; } } };
    RegisterAction<key_pair_t, bit<32>, bit<8>>(agg_key) key_probe = { void apply(inout key_pair_t v, out bit<8> r) {
        if (v.hi == meta.key_hi && v.lo == hdr.atp.seq) { r = K_MATCH; } else { r = K_COLLIDE; } } };
    // bitmap: ④ test-and-set; returns the bitmap after the update (or 0 on a duplicate)
    RegisterAction<atp_bitmap_t, bit<32>, atp_bitmap_t>(agg_bitmap) bm_write = { void apply(inout atp_bitmap_t v, out atp_bitmap_t r) { v = meta.atp.bm; r = v; } };
    RegisterAction<atp_bitmap_t, bit<32>, atp_bitmap_t>(agg_bitmap) bm_merge = { void apply(inout atp_bitmap_t v, out atp_bitmap_t r) {
        if ((v & meta.atp.bm) == 0) { v = v | meta.atp.bm; r = v; } else { r = 0; } } };
    RegisterAction<atp_bitmap_t, bit<32>, atp_bitmap_t>(agg_bitmap) bm_merge_clear = { void apply(inout atp_bitmap_t v, out atp_bitmap_t r) { r = v; v = 0; } };  // returns the old bitmap
    RegisterAction<atp_bitmap_t, bit<32>, atp_bitmap_t>(agg_bitmap) bm_read_clear = { void apply(inout atp_bitmap_t v, out atp_bitmap_t r) { r = v; v = 0; } };
    RegisterAction<atp_bitmap_t, bit<32>, atp_bitmap_t>(agg_bitmap) bm_clear = { void apply(inout atp_bitmap_t v, out atp_bitmap_t r) { v = 0; r = 0; } };
    // count: ⑤ popcount, ⑥ compared with the fan-in by the caller
    RegisterAction<atp_fan_t, bit<32>, atp_fan_t>(agg_count) cnt_set1 = { void apply(inout atp_fan_t v, out atp_fan_t r) { v = 1; r = 1; } };
    RegisterAction<atp_fan_t, bit<32>, atp_fan_t>(agg_count) cnt_inc = { void apply(inout atp_fan_t v, out atp_fan_t r) { v = v + 1; r = v; } };
    RegisterAction<atp_fan_t, bit<32>, atp_fan_t>(agg_count) cnt_clear = { void apply(inout atp_fan_t v, out atp_fan_t r) { v = 0; r = 0; } };
    // flags: ECN / overflow OR-ed through aggregation
    RegisterAction<bit<8>, bit<32>, bit<8>>(agg_flags) fl_or = { void apply(inout bit<8> v, out bit<8> r) {
        v = v | (6w0 ++ hdr.atp.overflow ++ hdr.atp.ecn); r = v; } };
    RegisterAction<bit<8>, bit<32>, bit<8>>(agg_flags) fl_read_clear = { void apply(inout bit<8> v, out bit<8> r) {
        r = v | (6w0 ++ hdr.atp.overflow ++ hdr.atp.ecn); v = 0; } };
    RegisterAction<bit<32>, bit<18>, bit<32>>(wm) wm_max = { void apply(inout bit<32> v, out bit<32> r) {
        if (hdr.atp.watermark > v) { v = hdr.atp.watermark; } r = v; } };
    RegisterAction<bit<32>, bit<18>, bit<32>>(wm) wm_read = { void apply(inout bit<32> v, out bit<32> r) { r = v; } };

    atp_bitmap_t b = 0;
    atp_fan_t cnt = 0;
    bit<8> f = 0;

    action drop() { ig_dprsr_md.drop_ctl = 1; meta.atp.forward = 0; }
    action set_port(PortId_t port) { ig_tm_md.ucast_egress_port = port; }
    action set_job(bit<16> grp) { meta.atp.mcast_grp = grp; }
    action set_flush(MirrorId_t session) { meta.session = session; }
    table ipv4_route { key = { hdr.ipv4.dst_addr: lpm; } actions = { set_port; drop; } default_action = drop(); }
    table l2_forward { key = { hdr.ethernet.dst_addr: exact; } actions = { set_port; drop; } default_action = drop(); }
    table atp_job { key = { hdr.atp.job: exact; } actions = { set_job; NoAction; } default_action = NoAction(); }
    table flush_session { key = { ig_md.ingress_port: exact; } actions = { set_flush; } default_action = set_flush(1); }

    apply {
        meta.atp.forward = 1;
        if (hdr.atp.isValid()) {
            if (!atp_job.apply().hit) { drop(); exit; }
            meta.atp.h = crc.get({ hdr.atp.job, hdr.atp.seq });
            meta.atp.idx = meta.atp.h & (ATP_N_AGG - 1);  // switch.agg_slot: a power-of-two mask, no modulo
            meta.key_hi = 32w0x40000 | (14w0 ++ hdr.atp.ps_index ++ hdr.atp.job);
            if (hdr.atp.edge == 0) { meta.atp.fan_in = hdr.atp.fan_in0; meta.atp.bm = hdr.atp.bitmap0; }  // ③
            else { meta.atp.fan_in = hdr.atp.fan_in1; meta.atp.bm = hdr.atp.bitmap1; }
            if (hdr.atp.is_param == 1) {
                wm_max.execute(hdr.atp.job ++ hdr.atp.ps_index);
                meta.kst = key_free_on_match.execute(meta.atp.idx);
                if (meta.kst == K_MATCH) {  // ② deallocate every field
                    bm_clear.execute(meta.atp.idx); cnt_clear.execute(meta.atp.idx);
                    fl_read_clear.execute(meta.atp.idx); lanes_clear();
                }
                ig_tm_md.mcast_grp_a = meta.atp.mcast_grp;  // multicast to the job's workers
                exit;
            }
            if (meta.atp.fan_in == 0) {
                // no aggregation service here: plain forward (header sanity as the v1model mirror)
            } else if (meta.atp.bm == 0 || (meta.atp.bm & (meta.atp.bm - 1)) != 0) {
                drop(); exit;  // malformed: exactly one child (fan-in range checks by the job table)
            } else {
                meta.atp.wm = wm_read.execute(hdr.atp.job ++ hdr.atp.ps_index);
                if (hdr.atp.seq < meta.atp.wm) { hdr.atp.resend = 1; hdr.atp.edge = ~hdr.atp.edge; }
                else if (hdr.atp.resend == 1 && hdr.atp.edge == 1 && hdr.atp.agg1 == 0) {
                    // ⑦ first pass: forward the retransmission untouched (edge 0); mirror a copy
                    // to the recirculation port to flush the aggregator in a second pass
                    hdr.atp.agg_index = meta.atp.h;
                    meta.kst = key_probe.execute(meta.atp.idx);
                    if (meta.kst == K_MATCH) { flush_session.apply(); ig_dprsr_md.mirror_type = 1; }
                    else { hdr.atp.collision = 1; }
                    hdr.atp.edge = ~hdr.atp.edge;
                } else if (hdr.atp.resend == 1) {
                    // level 0 (④⑧⑨⑩) or the ⑦ flush pass (agg1 = 1): read-and-clear on a match
                    hdr.atp.agg_index = meta.atp.h;
                    meta.kst = key_free_on_match.execute(meta.atp.idx);
                    if (meta.kst == K_MATCH) {
                        if (hdr.atp.edge == 0) {
                            b = bm_merge_clear.execute(meta.atp.idx);
                            if ((b & meta.atp.bm) == 0) { lanes_add_clear(); }  // ④ merge, ⑨ carry, ⑩ clear
                            else { lanes_read_clear(); }                        // ⑧ already merged
                            hdr.atp.bitmap0 = b | meta.atp.bm; hdr.atp.edge = 1;
                        } else {
                            b = bm_read_clear.execute(meta.atp.idx);
                            lanes_read_clear();
                            hdr.atp.bitmap1 = b; hdr.atp.edge = 0;
                        }
                        cnt_clear.execute(meta.atp.idx);
                        f = fl_read_clear.execute(meta.atp.idx);
                        hdr.atp.ecn = f[0:0]; hdr.atp.overflow = f[1:1];
                    } else {
                        if (meta.kst == K_COLLIDE) { hdr.atp.collision = 1; }
                        hdr.atp.edge = ~hdr.atp.edge;
                    }
                } else {
                    hdr.atp.agg_index = meta.atp.h;
                    meta.kst = key_grad.execute(meta.atp.idx);
                    if (meta.kst == K_ALLOC) {  // allocation
                        b = bm_write.execute(meta.atp.idx);
                        cnt = cnt_set1.execute(meta.atp.idx);
                        f = fl_or.execute(meta.atp.idx);
                        lanes_write();
                    } else if (meta.kst == K_COLLIDE) {  // ① occupied: resend, level flip
                        hdr.atp.resend = 1; hdr.atp.collision = 1; hdr.atp.edge = ~hdr.atp.edge;
                    } else {
                        b = bm_merge.execute(meta.atp.idx);  // ①④
                        if (b == 0) { drop(); exit; }  // ④ duplicate
                        cnt = cnt_inc.execute(meta.atp.idx);  // ⑤
                        f = fl_or.execute(meta.atp.idx);
                        lanes_add();
                    }
                    if (meta.kst != K_COLLIDE) {
                        if (cnt < meta.atp.fan_in) { drop(); exit; }  // ⑥ consumed
                        if (hdr.atp.edge == 0) { hdr.atp.bitmap0 = b; } else { hdr.atp.bitmap1 = b; hdr.atp.agg1 = 1; }
                        hdr.atp.ecn = f[0:0]; hdr.atp.overflow = f[1:1];
                        hdr.atp.edge = ~hdr.atp.edge;  // ⑥ complete: upstream
                    }
                }
            }
        }
        if (meta.atp.forward == 1) {
            if (hdr.ipv4.isValid()) { ipv4_route.apply(); } else { l2_forward.apply(); }
        }
    }
}

control IgDeparser(packet_out pkt, inout headers_t hdr, in ig_meta_t meta,
                   in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Mirror() mirror;
    apply {
        if (ig_dprsr_md.mirror_type == 1) { mirror.emit(meta.session); }  // ⑦ flush copy
        pkt.emit(hdr);
    }
}

parser EgParser(packet_in pkt, out headers_t hdr, out eg_meta_t meta, out egress_intrinsic_metadata_t eg_md) {
    state start { pkt.extract(eg_md); transition ethernet; }
    state ethernet { pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) { ETHERTYPE_IPV4: ipv4; default: accept; } }
    state ipv4 { pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) { IPPROTO_UDP: udp; default: accept; } }
    state udp { pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) { ATP_UDP_PORT: atp; default: accept; } }
    state atp { pkt.extract(hdr.atp); pkt.extract(hdr.atp_data); transition accept; }
}

control Eg(inout headers_t hdr, inout eg_meta_t meta, in egress_intrinsic_metadata_t eg_md,
           in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
           inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
           inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    bit<19> thr = 0;
    action set_threshold(bit<19> t) { thr = t; }
    table ecn_threshold { key = { eg_md.egress_port: exact; } actions = { set_threshold; } default_action = set_threshold(19w0x7FFFF); }
    apply {
        if (hdr.atp.isValid()) {
            if (eg_md.pkt_length != 0 && hdr.atp.resend == 1 && hdr.atp.edge == 0 && eg_md.egress_port[6:0] == 68) {
                hdr.atp.agg1 = 1; hdr.atp.edge = 1;  // ⑦ copy bound for the recirculation port (68): flush pass
            }
            ecn_threshold.apply();
            if (eg_md.enq_qdepth > thr) { hdr.atp.ecn = 1; }  // switch.ecn_mark (§5.4)
        }
    }
}

control EgDeparser(packet_out pkt, inout headers_t hdr, in eg_meta_t meta,
                   in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    apply { pkt.emit(hdr); }
}

Pipeline(IgParser(), Ig(), IgDeparser(), EgParser(), Eg(), EgDeparser()) pipe;
Switch(pipe) main;
