use super::*;
use crate::{
    config::Mode,
    dns::{Handler, ZoneConfig, udp::encode_udp_response},
    endpoints::ServiceView,
    metrics::Metrics,
    model::{Object, parse_documents},
};
use arc_swap::ArcSwap;
use hickory_proto::{
    op::Message,
    rr::{Name, RData},
};
use hickory_server::{
    net::{NetError, runtime::TokioTime, xfer::Protocol},
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
    zone_handler::MessageResponse,
};
use std::{
    str::FromStr,
    sync::{Arc, Mutex},
};

/// Catches what the hickory path sends.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Option<Vec<u8>>>>);

#[async_trait::async_trait]
impl ResponseHandler for Capture {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a hickory_proto::rr::Record> + Send + 'a,
            impl Iterator<Item = &'a hickory_proto::rr::Record> + Send + 'a,
            impl Iterator<Item = &'a hickory_proto::rr::Record> + Send + 'a,
            impl Iterator<Item = &'a hickory_proto::rr::Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let (info, bytes) = encode_udp_response(response)?;
        *crate::lock::lock(&self.0) = Some(bytes);
        Ok(info)
    }
}

fn services() -> Vec<ServiceView> {
    let mut yaml = String::from(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n\
         spec:\n  ports: [{name: http, port: 80}]\n  \
         discovery: {vips: [198.18.100.10, 'fd00:100::10']}\n---\n\
         apiVersion: rune/v1\nkind: Service\nmetadata: {name: big}\n\
         spec: {discovery: {headless: true}}\n---\n\
         apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: big}\nspec:\n  endpoints:\n",
    );
    for i in 0..100 {
        yaml.push_str(&format!("    - {{address: 198.18.2.{i}, ready: true}}\n"));
    }
    let mut objects = parse_documents(&yaml).unwrap().into_iter();
    let mut view = |endpoints: bool| {
        let Some(Object::Service(service)) = objects.next() else {
            panic!("not a service")
        };
        let endpoints = endpoints.then(|| match objects.next() {
            Some(Object::Endpoints(e)) => Arc::new(e),
            other => panic!("{other:?}"),
        });
        ServiceView {
            service: Arc::new(service),
            endpoints,
        }
    };
    vec![view(false), view(true)]
}

fn handler(recursion: bool) -> Handler {
    let config = ZoneConfig {
        domain: "rune.".into(),
        ttl: 5,
        mode: Mode::Production,
        dev_port_offset: 0,
    };
    let zone = Zone::build(&config, 9, &services()).unwrap();
    let forwarder = recursion.then(|| {
        // Never asked: every question in these tests is in the zone.
        crate::dns::Forwarder::new(
            vec!["127.0.0.1:9".parse().unwrap()],
            std::time::Duration::from_millis(100),
            0,
            Arc::new(Metrics::new()),
        )
    });
    Handler {
        zone: Arc::new(ArcSwap::from_pointee(zone)),
        metrics: Arc::new(Metrics::new()),
        forwarder,
    }
}

/// A query as a client sends it: the name's case as given, RD set, optional
/// EDNS with `payload`.
fn query(id: u16, name: &str, qtype: u16, edns: Option<u16>) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, u8::from(edns.is_some())]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes());
    if let Some(payload) = edns {
        q.extend_from_slice(&[0, 0, 41]);
        q.extend_from_slice(&payload.to_be_bytes());
        q.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    }
    q
}

fn fast(h: &Handler, q: &[u8]) -> Option<Vec<u8>> {
    let mut out = [0u8; 4096];
    let zone = h.zone.load();
    answer(&zone, q, h.forwarder.is_some(), &mut out).map(|a| out[..a.len].to_vec())
}

async fn slow(h: &Handler, q: &[u8]) -> Vec<u8> {
    let request =
        Request::from_bytes(q.to_vec(), "127.0.0.1:5353".parse().unwrap(), Protocol::Udp).unwrap();
    let capture = Capture::default();
    h.handle_request::<_, TokioTime>(&request, capture.clone())
        .await;
    crate::lock::lock(&capture.0)
        .take()
        .expect("hickory sent nothing")
}

fn question_end(q: &[u8]) -> usize {
    let mut at = 12;
    while q[at] != 0 {
        at += 1 + usize::from(q[at]);
    }
    at + 5
}

/// Both paths answer `q` alike: the same header bytes and question bytes, the
/// same records (names compared without case) and EDNS. Returns the fast answer.
async fn same_as_hickory(h: &Handler, q: &[u8]) -> Message {
    let fast_bytes = fast(h, q).expect("the fast path declined");
    let slow_bytes = slow(h, q).await;
    assert_eq!(fast_bytes[..12], slow_bytes[..12], "header");
    let end = question_end(q);
    assert_eq!(fast_bytes[12..end], q[12..end], "question as sent");
    assert_eq!(slow_bytes[12..end], q[12..end], "hickory's question");
    let f = Message::from_vec(&fast_bytes).unwrap();
    let s = Message::from_vec(&slow_bytes).unwrap();
    assert_eq!(f.answers, s.answers);
    assert_eq!(f.authorities, s.authorities);
    assert_eq!(f.additionals, s.additionals);
    assert_eq!(f.edns, s.edns);
    f
}

#[tokio::test]
async fn an_a_answer_matches_hickorys_byte_for_byte_in_the_header() {
    let h = handler(false);
    let q = query(0xbeef, "web.shop.rune.", 1, None);
    let m = same_as_hickory(&h, &q).await;
    assert_eq!(m.metadata.id, 0xbeef);
    assert!(m.metadata.authoritative && m.metadata.recursion_desired);
    assert!(!m.metadata.recursion_available && !m.metadata.truncation);
    match m.answers.as_slice() {
        [r] => assert_eq!(
            r.data,
            RData::A(hickory_proto::rr::rdata::A::new(198, 18, 100, 10))
        ),
        other => panic!("{other:?}"),
    }
    // AAAA, SRV and PTR take the same path.
    same_as_hickory(&h, &query(2, "web.shop.rune.", 28, None)).await;
    same_as_hickory(&h, &query(3, "_http._tcp.web.shop.rune.", 33, None)).await;
    same_as_hickory(&h, &query(4, "10.100.18.198.in-addr.arpa.", 12, None)).await;
    same_as_hickory(&h, &query(5, "rune.", 6, None)).await;
    same_as_hickory(&h, &query(6, "rune.", 2, None)).await;
}

#[tokio::test]
async fn the_clients_case_and_rd_bit_are_kept_and_ra_follows_the_forwarder() {
    let h = handler(true);
    let mut q = query(7, "WeB.sHoP.RUNE.", 1, None);
    q[2] = 0; // RD off
    let m = same_as_hickory(&h, &q).await;
    assert!(!m.metadata.recursion_desired);
    assert!(m.metadata.recursion_available);
    // The answer's owner is the question, as the client spelled it.
    assert_eq!(m.answers[0].name.to_ascii(), "WeB.sHoP.RUNE.");
}

#[tokio::test]
async fn edns_is_answered_with_the_clients_payload_at_least_512() {
    let h = handler(false);
    for (asked, answered) in [(1232u16, 1232u16), (100, 512), (4096, 4096)] {
        let m = same_as_hickory(&h, &query(8, "web.shop.rune.", 1, Some(asked))).await;
        let edns = m.edns.expect("no OPT in the answer");
        assert_eq!(edns.max_payload(), answered);
        assert_eq!(edns.version(), 0);
    }
    // No OPT asked, none answered.
    let m = same_as_hickory(&h, &query(9, "web.shop.rune.", 1, None)).await;
    assert!(m.edns.is_none());
}

#[tokio::test]
async fn nxdomain_and_nodata_carry_the_soa() {
    let h = handler(false);
    let nx = same_as_hickory(&h, &query(10, "nope.shop.rune.", 1, Some(1232))).await;
    assert_eq!(nx.metadata.response_code, ResponseCode::NXDomain);
    assert!(nx.metadata.authoritative && nx.answers.is_empty());
    match nx.authorities.as_slice() {
        [soa] => {
            assert_eq!(soa.name, Name::from_str("rune.").unwrap());
            assert!(matches!(&soa.data, RData::SOA(s) if s.serial == 9 && s.minimum == 5));
        }
        other => panic!("{other:?}"),
    }
    let nodata = same_as_hickory(&h, &query(11, "web.shop.rune.", 16, None)).await;
    assert_eq!(nodata.metadata.response_code, ResponseCode::NoError);
    assert!(nodata.answers.is_empty());
    assert_eq!(nodata.authorities.len(), 1);
    // An empty non-terminal (the namespace) is NODATA too.
    let ent = same_as_hickory(&h, &query(12, "shop.rune.", 1, None)).await;
    assert_eq!(ent.metadata.response_code, ResponseCode::NoError);
}

#[tokio::test]
async fn an_answer_over_the_udp_limit_is_truncated_like_hickorys() {
    let h = handler(false);
    let q = query(13, "big.default.rune.", 1, None);
    let fast_bytes = fast(&h, &q).expect("the fast path declined");
    assert!(fast_bytes.len() <= 512);
    let f = Message::from_vec(&fast_bytes).unwrap();
    let s = Message::from_vec(&slow(&h, &q).await).unwrap();
    assert!(f.metadata.truncation && s.metadata.truncation);
    assert!(!f.answers.is_empty() && f.answers.len() < 100);
    // What fits is the start of the full answer.
    let full =
        Message::from_vec(&fast(&h, &query(14, "big.default.rune.", 1, Some(4096))).unwrap())
            .unwrap();
    assert!(!full.metadata.truncation);
    assert_eq!(full.answers.len(), 100);
    assert_eq!(f.answers[..], full.answers[..f.answers.len()]);
    same_as_hickory(&h, &query(15, "big.default.rune.", 1, Some(4096))).await;
    // A client announcing more than the fast path's buffer gets hickory.
    let mut out = [0u8; 600];
    let zone = h.zone.load();
    let q = query(16, "big.default.rune.", 1, Some(4096));
    assert_eq!(answer(&zone, &q, false, &mut out), None);
}

#[test]
fn anything_unusual_is_left_to_hickory() {
    let h = handler(false);
    let good = query(17, "web.shop.rune.", 1, None);
    assert!(fast(&h, &good).is_some());
    let declined = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut q = good.clone();
        edit(&mut q);
        fast(&h, &q)
    };
    assert_eq!(
        fast(&h, &query(18, "example.com.", 1, None)),
        None,
        "outside the zone"
    );
    assert_eq!(declined(&|q| q[2] |= 0x80), None, "a response");
    assert_eq!(declined(&|q| q[2] |= 4 << 3), None, "NOTIFY");
    assert_eq!(declined(&|q| q[2] |= 0x02), None, "TC in a query");
    assert_eq!(declined(&|q| q[3] |= 0x40), None, "Z bit");
    assert_eq!(declined(&|q| q[5] = 2), None, "two questions");
    assert_eq!(declined(&|q| q[7] = 1), None, "an answer in a query");
    assert_eq!(declined(&|q| q.push(0)), None, "trailing bytes");
    assert_eq!(declined(&|q| q.truncate(q.len() - 1)), None, "cut short");
    let class = good.len() - 1;
    assert_eq!(declined(&|q| q[class] = 3), None, "class CH");
    assert_eq!(declined(&|q| q[12] = 0xc0), None, "a compression pointer");
    let mut edns = query(19, "web.shop.rune.", 1, Some(1232));
    let version = edns.len() - 5;
    edns[version] = 1;
    assert_eq!(fast(&h, &edns), None, "EDNS version 1");
    assert_eq!(fast(&h, &query(20, "rune.", 252, None)), None, "AXFR");
    assert_eq!(fast(&h, &[0u8; 11]), None, "short");
    // A name longer than 255 bytes in wire form.
    let long = format!("{}rune.", "a123456789.".repeat(24));
    assert_eq!(fast(&h, &query(21, &long, 1, None)), None, "long name");
}

#[test]
fn edns_options_are_skipped_and_do_is_not_echoed() {
    let h = handler(false);
    let mut q = query(22, "web.shop.rune.", 1, Some(1232));
    // DO bit and a cookie option (8 bytes of client cookie).
    let flags = q.len() - 4;
    q[flags] = 0x80;
    let rdlen = q.len() - 2;
    q[rdlen..].copy_from_slice(&12u16.to_be_bytes());
    q.extend_from_slice(&[0, 10, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]);
    let m = Message::from_vec(&fast(&h, &q).unwrap()).unwrap();
    let edns = m.edns.unwrap();
    assert!(!edns.flags().dnssec_ok);
    assert_eq!(m.answers.len(), 1);
}
