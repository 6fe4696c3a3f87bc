// Shared by p4/v1model/atp.p4 and p4/tna/atp.p4: L2-L4 headers, the parsed-header
// struct and ATP metadata. The ATP header itself is generated (../generated/atp_headers.p4).
#ifndef ATP_COMMON_P4
#define ATP_COMMON_P4
#include "../generated/atp_headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IPPROTO_UDP = 17;

header ethernet_t { bit<48> dst_addr; bit<48> src_addr; bit<16> ether_type; }
header ipv4_t {
    bit<4> version; bit<4> ihl; bit<8> diffserv; bit<16> total_len; bit<16> identification;
    bit<3> flags; bit<13> frag_offset; bit<8> ttl; bit<8> protocol; bit<16> hdr_checksum;
    bit<32> src_addr; bit<32> dst_addr;
}
header udp_t { bit<16> src_port; bit<16> dst_port; bit<16> length; bit<16> checksum; }

struct headers_t {
    ethernet_t ethernet;
    ipv4_t ipv4;
    udp_t udp;
    atp_t atp;
    atp_data_t atp_data;
}

struct atp_meta_t {
    bit<32> idx;        // aggregator index = CRC32(job, seq) & (ATP_N_AGG - 1) (§5.3, switch.agg_slot)
    bit<32> h;          // CRC32(job, seq) -> atp.agg_index
    bit<16> mcast_grp;  // the job's multicast group (§5.1 job setup)
    atp_fan_t fan_in;   // ③ this level's fan-in
    atp_bitmap_t bm;    // ③ this level's one-hot bitmap
    bit<32> wm;         // watermark of the packet's <job, ps_index>
    bit<1> forward;     // 1: route the (possibly rewritten) packet
}
#endif
