//! The nftables messages: well-formed netlink, attributes that round-trip.
use super::*;

#[test]
fn messages_are_well_formed_netlink() {
    let rule = MasqueradeRule::new(0x1000, 0x1000);
    let mut seq = 0;
    let batch = replace_batch(&rule, &mut seq);
    // Walk the messages: lengths add up, types are what we meant.
    let mut b = &batch[..];
    let mut types = Vec::new();
    while !b.is_empty() {
        let len = u32::from_ne_bytes(b[..4].try_into().unwrap()) as usize;
        assert!(len >= 20 && len.is_multiple_of(4) && len <= b.len());
        types.push(u16::from_ne_bytes([b[4], b[5]]));
        b = &b[len..];
    }
    let nft = |op| (NFNL_SUBSYS_NFTABLES << 8) | op;
    assert_eq!(
        types,
        [
            NFNL_MSG_BATCH_BEGIN,
            nft(NFT_MSG_NEWTABLE),
            nft(NFT_MSG_DELTABLE),
            nft(NFT_MSG_NEWTABLE),
            nft(NFT_MSG_NEWCHAIN),
            nft(NFT_MSG_NEWRULE),
            NFNL_MSG_BATCH_END
        ]
    );
    assert_eq!(seq, 7);
}

#[test]
fn attributes_round_trip() {
    let mut m = Msg::nft(NFT_MSG_NEWRULE, 0, 1);
    m.str(NFTA_RULE_TABLE, "kilo")
        .nested(NFTA_RULE_EXPRESSIONS, |m| {
            expr(m, "masq", |_| {});
        });
    let msg = m.finish();
    let a = attrs(&msg[20..]);
    assert_eq!(get(&a, NFTA_RULE_TABLE).map(cstr).as_deref(), Some("kilo"));
    let list = attrs(get(&a, NFTA_RULE_EXPRESSIONS).unwrap());
    assert_eq!(
        get(&attrs(list[0].1), NFTA_EXPR_NAME).map(cstr).as_deref(),
        Some("masq")
    );
    assert_eq!(
        udata_comment("ab"),
        vec![NFTNL_UDATA_RULE_COMMENT, 3, b'a', b'b', 0]
    );
}
